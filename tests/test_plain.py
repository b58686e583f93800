"""Text cut to fit a line or MLflow's limits is cut at a word and says how much was left out
(issue 28: "no error text cut mid-word"): names.shorten, and the error lines that use it."""

from __future__ import annotations

import pytest

from mlflow_llmeff.names import shorten


def test_text_that_fits_is_whole():
    assert shorten("RuntimeError: boom", 18) == "RuntimeError: boom"


def test_a_cut_ends_at_a_word_and_counts_what_it_left_out():
    text = "RuntimeError: the quick brown fox jumps over the lazy dog " * 5  # 290 characters
    # the marker " … (290 more characters)" is 24 long, so 36 characters of room: the last space
    # within them is after "fox" (34), and 290 - 33 characters are left out
    out = shorten(text, 60)
    assert out == "RuntimeError: the quick brown fox \u2026 (257 more characters)"
    assert len(out) <= 60


def test_a_text_without_a_space_is_cut_mid_token_and_still_marked():
    # a path or a hash: 40 - len(" … (100 more characters)") = 16 characters of room, none a space
    assert shorten("a" * 100, 40) == "a" * 16 + " \u2026 (84 more characters)"


def test_a_limit_too_small_for_the_marker_cuts_plainly_and_a_bad_limit_is_refused():
    assert shorten("abcdefghij" * 3, 5) == "abcde"
    with pytest.raises(ValueError, match=r"limit=0 is not accepted; give at least 1 character"):
        shorten("x", 0)


def test_a_run_error_line_over_mlflows_room_is_cut_at_a_word():
    from mlflow_llmeff.tracking.runs import error_line

    line = error_line(RuntimeError("word " * 1000))  # "RuntimeError: word word ..." 5,013 characters
    assert len(line) <= 2000 and line.endswith("more characters)")
    head, _, rest = line.partition(" \u2026 (")
    assert head.endswith("word") and head.startswith("RuntimeError: word")
    assert int(rest.split()[0].replace(",", "")) == len("RuntimeError: " + ("word " * 1000).strip()) - len(head)


def test_a_delivery_failure_reason_is_cut_at_a_word():
    from mlflow_llmeff.tracking.worker import _reason

    out = _reason(ValueError("invalid value " * 40))  # 14 x 40 = 560 characters of message
    assert len(out) <= 200 and out.startswith("ValueError: invalid value") and "more characters)" in out
    assert out.split(" \u2026 ")[0].endswith(("invalid", "value"))


def test_the_packages_own_warning_is_one_plain_line_and_others_keep_pythons_format():
    import subprocess
    import sys

    code = ("import warnings, mlflow_llmeff\n"
            "warnings.warn('mlflow_llmeff: MLflow logging failed (MlflowException: refused); training continues')\n"
            "warnings.warn('a library of theirs', DeprecationWarning, stacklevel=1)\n")
    err = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True,
                         check=True).stderr.splitlines()
    assert err[0] == "mlflow_llmeff: MLflow logging failed (MlflowException: refused); training continues (UserWarning)"
    assert err[1] == "<string>:3: DeprecationWarning: a library of theirs"  # Python's own format, untouched
    assert len(err) == 2
