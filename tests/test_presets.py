"""models/presets.py: a preset's shape read without transformers (:class:`PresetShape`) answers as its
transformers config does, for every reader of shapes (``llmeff train``'s own process hands off on it)."""

import pathlib

import pytest

from mlflow_llmeff.calc.model_shape import model_shape, param_counts
from mlflow_llmeff.models import presets
from mlflow_llmeff.models.presets import PRESETS, PresetShape, load_config, shape_config
from mlflow_llmeff.planning import plan


def test_the_recorded_shapes_are_what_the_installed_transformers_builds():
    # regenerate (the module's docstring says how) when transformers changes a preset's config
    recorded = pathlib.Path(presets.__file__).with_name("preset_shapes.py").read_text(encoding="utf-8")
    assert recorded == presets.render_shapes()


@pytest.mark.parametrize("name", list(PRESETS))
def test_a_presets_shape_answers_every_field_as_its_transformers_config(name):
    light, full = shape_config(name), load_config(name)
    assert isinstance(light, PresetShape)
    fields = {k: v for k, v in vars(light).items() if not k.startswith("_")}
    assert len(fields) >= 30  # to_dict()'s fields (32 for Mistral, 34 for Llama, 43 for GPT-2 with its aliases)
    assert fields == {k: getattr(full, k) for k in fields}
    assert light.param_shapes() == plan.param_shapes(full)  # the meta device's model.parameters()


@pytest.mark.parametrize("name", list(PRESETS))
def test_the_shape_readers_give_the_same_figures_for_a_presets_shape(name):
    light, full = shape_config(name), load_config(name)
    assert model_shape(light) == model_shape(full)
    assert param_counts(light) == param_counts(full)
    assert plan.meta_param_count(light) == plan.meta_param_count(full)
    assert presets.max_positions(light) == presets.max_positions(full)
    for strategy, optimizer in (("ddp", "adamw"), ("deepspeed_zero3", "adamw"), ("single", "adafactor")):
        kw = dict(seq_len=128, micro_batch_size=2, strategy=strategy, dp=2, precision="bf16", optimizer=optimizer)
        assert plan.estimate_memory(light, **kw) == plan.estimate_memory(full, **kw)


def test_squeezed_shapes_expand_to_the_list_they_came_from():
    shapes = [(259, 64), (64, 64), (32, 64), (64, 64), (32, 64), (64,), (64,), (64,), (259, 64)]
    runs = presets.squeeze_shapes(shapes)
    assert runs == [(259, 64), [2, [(64, 64), (32, 64)]], [3, [(64,)]], (259, 64)]
    assert presets.expand_shapes(runs) == shapes


def test_a_model_that_is_no_preset_is_read_through_transformers(tmp_path):
    with pytest.raises(ValueError, match=r"^unknown model 'nope'; accepted: a preset \(llama-tiny, "):
        shape_config("nope")


def test_a_hub_id_that_cannot_be_loaded_says_why_in_one_line(monkeypatch):
    # a trial offline waited for the hub's retries, then read only "(OSError)": the cause's first sentence now
    import transformers

    def offline(*a, **k):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them "
                      "in the cached files.\nCheck your internet connection or see how to run the library in "
                      "offline mode.")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ValueError) as e:
        load_config("meta-llama/Llama-2-7b-hf")
    assert str(e.value).startswith(
        "model 'meta-llama/Llama-2-7b-hf' is not a preset, not a local directory, and could not be loaded from the "
        "Hugging Face hub (OSError: We couldn't connect to 'https://huggingface.co' to load the files, and couldn't "
        "find them in the cached files; HF_HUB_OFFLINE=1 reads the local cache only); presets: llama-tiny, ")
    assert "\n" not in str(e.value)
