"""Hand-made evaluation documents for the tests, written into a temporary folder in the original
release layout (:func:`eval_fixture_dir`): invented questions, not MMLU or HellaSwag data, so no
copy of a data set lives in the repository; tests that need the real data read ../shared.

Layout and formats: ``mmlu/{dev,test}/<subject>_{dev,test}.csv`` (no header: question,A,B,C,D,answer)
and ``hellaswag/hellaswag_val.jsonl`` (one raw record per line; record 2 exercises ``[title]``,
bracket removal, double spaces and ``str.capitalize``; record 3 has an empty ``ctx_b`` and a string
label). The loaders read these names, so the tests exercise the layout a user has.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile

#: relative path -> exact file text
FILES: dict[str, str] = {
    'hellaswag/hellaswag_val.jsonl': (
        '{"ind": 1, "activity_label": "Making tea", "ctx_a": "A woman fills a kettle with water.", "ctx_b": "she", "ctx": "", "split": "val", "split_type": "indomain", "label": 2, "endings": ["throws the kettle out of the window.", "eats the kettle.", "puts the kettle on the stove.", "sings to the water."], "source_id": "invented~1"}\n'
        '{"ind": 2, "activity_label": "Tying shoes", "ctx_a": "[header] How to tie shoes [title] Cross the laces.", "ctx_b": "Pull The ends", "ctx": "", "split": "val", "split_type": "zeroshot", "label": 0, "endings": [" tight [step] and make a loop.", "into the  sky.", "[substeps] apart and walk away.", "sideways."], "source_id": "invented~2"}\n'
        '{"ind": 3, "activity_label": "Running", "ctx_a": "A man runs on a track.", "ctx_b": "", "ctx": "", "split": "val", "split_type": "indomain", "label": "1", "endings": ["He stops.", "He keeps running around the track.", "He flies.", "He sits down on the track and rests for an hour."], "source_id": "invented~3"}\n'
    ),
    'mmlu/dev/abstract_algebra_dev.csv': (
        'What is 1 + 1 in Z_2?,0,1,2,3,A\n'
        'How many elements does the trivial group have?,0,1,2,infinitely many,B\n'
        '"Statement 1 | Every cyclic group is abelian. Statement 2 | Z_4 is cyclic.","True, True","False, False","True, False","False, True",A\n'
        'What is the order of 3 in Z_6?,1,2,3,6,B\n'
        'Which of these is a field?,Z_4,Z_6,Z_5,Z_8,C\n'
    ),
    'mmlu/dev/anatomy_dev.csv': (
        'Which organ pumps blood?,lung,heart,liver,kidney,B\n'
        'How many chambers has the human heart?,two,three,four,five,C\n'
        'Where is the femur?,arm,leg,skull,hand,B\n'
        'What do lungs exchange?,gases,bones,hormones,nerves,A\n'
        'Which bone protects the brain?,rib,skull,pelvis,spine,B\n'
    ),
    'mmlu/test/abstract_algebra_test.csv': (
        'What is 2 + 2 in Z_3?,0,1,2,3,B\n'
        '"Is Z_7 a field, yes or no?",yes,no,"only for odd n, not here",it depends,A\n'
        '  How many subgroups does Z_2 have?  ,1,2,3,4,B\n'
    ),
    'mmlu/test/anatomy_test.csv': (
        'Which organ filters blood?,heart,kidney,stomach,skin,B\n'
        '"The ""funny bone"" is a:",bone,nerve,muscle,tendon,B\n'
    ),
}


@functools.lru_cache(maxsize=None)
def eval_fixture_dir() -> str:
    """A folder holding :data:`FILES` (written once per test session, removed at exit)."""
    root = tempfile.mkdtemp(prefix="llmeff_eval_fixtures_")
    atexit.register(shutil.rmtree, root, True)
    for rel, text in FILES.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
    return root


def tiny_llama():
    """A seeded 2-layer Llama of 32 hidden units over ByT5's bytes (259 tokens) in eval mode, and its tokenizer:
    what the eval tests score with."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, max_position_embeddings=512)
    return transformers.LlamaForCausalLM(cfg).eval(), transformers.ByT5Tokenizer(extra_ids=0)
