"""Prompts the target writes itself (`format: target_prompts`): the user prefix read off the chat template, the
filters and near-duplicate removal on hand-written strings, determinism under a seed, a journal of another seed
refused, and a `mtp-train prepare` killed with SIGKILL that resumes to the uninterrupted run's prompts and dataset."""

import hashlib
import signal
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from mtp_train.config import compose
from mtp_train.data import prepare as prep
from mtp_train.data import synthesize as synth
from mtp_train.data.sources import SourceConfig

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
          "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")  # SmolLM2's
# the tiny target's prompts are function descriptions ("Write `def f(x)`.\n\n<docstring>"): with these settings
# a batch of 2 ends a few of them within 40 tokens, so a run keeps 3 in 2 batches
SYNTH = ["seed=1", "target.device=cpu", "data.regenerate=true", "data.regen_batch_size=2",
         "data.synth_max_new_tokens=40", "data.regen_max_new_tokens=4"]
SOURCE = "data.sources=[{path: magpie, format: target_prompts, limit: 3, split: train}]"


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return AutoTokenizer.from_pretrained(tiny_dir / "target")


def test_the_prefix_ends_with_the_user_header(tok):
    assert synth.user_prefix(tok) == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
    chatml = AutoTokenizer.from_pretrained(Path(tok.name_or_path))
    chatml.chat_template = CHATML
    assert synth.user_prefix(chatml) == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                                         "Hugging Face<|im_end|>\n<|im_start|>user\n")
    assert synth.user_prefix(chatml, "Be brief.") == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"


@pytest.mark.parametrize("template, message", [
    ("", "has no chat template"),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "the same text before a user message as before an "
                                                              "assistant one (''): it has no user header"),
    ("{% for m in messages %}{% if m['role'] != 'user' %}{{ m['content'] }}{% endif %}{% endfor %}",
     "does not write a user message as given"),
    ("{{ raise_exception('roles must alternate') }}", "refused a conversation that starts with a user turn"),
])
def test_a_template_without_a_user_turn_is_refused(tiny_dir, template, message):
    t = AutoTokenizer.from_pretrained(tiny_dir / "target")
    t.chat_template = template or None
    with pytest.raises(ValueError, match="format target_prompts needs") as e:
        synth.user_prefix(t, where="tok")
    assert message in str(e.value)


@pytest.mark.parametrize("text, ended, reason", [
    ("How do I sort a list of dictionaries by a key?", False, "unfinished"),
    ("Tell me more.<|eot_id|><|start_header_id|>assistant", True, "special_tokens"),
    ("  Hi there \n", True, "too_short"),
    ("1234 + 5678 = ?", True, "no_letters"),
    ("go go go go go go go go go go", True, "repetitive"),
    ("the cat sat on the mat, the cat sat on the mat, the cat sat on the mat", True, "repetitive"),
    ("How do I sort a list of dictionaries by a key in Python?", True, None),
    ("Write `def f(x)`.\n\nReturn x squared; raise TypeError for strings.", True, None),
])
def test_filters(tok, text, ended, reason):
    assert synth.drop_reason(text, ended, synth.special_strings(tok)) == reason


def test_near_duplicates_by_word_trigram_jaccard():
    seen = synth.NearDuplicates()
    base = "How do I sort a list of dictionaries by a key in Python?"  # 13 words: 11 trigrams
    assert seen.add_if_new(base)
    assert not seen.add_if_new("how do i sort a LIST of dictionaries by a key in python")  # Jaccard 1
    assert not seen.add_if_new(base + " Thanks")  # 11 of 12 shared: 0.92
    assert seen.add_if_new("How do I sort a list of dictionaries by a value in Python?")  # 8 of 14: 0.57
    assert seen.add_if_new("Write a haiku about the sea.") and seen.add_if_new("Hi!") and not seen.add_if_new("hi")
    assert seen.sizes == [11, 11, 4, 1]  # the kept ones, indexed by their trigrams
    assert seen.index["by a key"] == [0] and seen.index["how do i"] == [0, 1]


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[Path, dict]:
    """An uninterrupted `prepare` of 3 prompts the tiny target wrote (seed 1), their replies regenerated."""
    run_dir = tmp_path_factory.mktemp("clean")
    return run_dir, prep.run(compose("tiny", [f"run_dir={run_dir}", *SYNTH, SOURCE]))


def _synthesize(run_dir: Path, *overrides: str, limit: int = 3) -> tuple[list[str], dict, bytes]:
    cfg = compose("tiny", [f"run_dir={run_dir}", *SYNTH, *overrides])
    tokenizer = AutoTokenizer.from_pretrained(cfg.target.path)
    src = SourceConfig(path="magpie", format="target_prompts", limit=limit)
    records, report = synth.synthesize(cfg, tokenizer, src)
    assert all(r.messages[-1] == {"role": "assistant", "content": ""} for r in records)
    return [r.messages[0]["content"] for r in records], report, Path(report["journal"]).read_bytes()


def test_the_same_seed_writes_the_same_prompts_another_seed_others(tmp_path, clean):
    a, report, journal = _synthesize(clean[0])  # read back from the clean run's journal: nothing sampled
    assert report["sampled_now"] == 0 and report == {**clean[1]["target_prompts"], **_timing(report)}
    assert len(a) == 3 and len(set(a)) == 3 and all(p.startswith("Write `def ") for p in a)
    assert report["attempts"] == 4 and report["dropped"] == {**dict.fromkeys(synth.FILTERS, 0), "unfinished": 1}
    b, report_b, journal_b = _synthesize(tmp_path / "b")
    assert (b, journal_b) == (a, journal) and report_b["sampled_now"] == 4
    c, _, journal_c = _synthesize(tmp_path / "c", "seed=2", limit=1)
    assert len(c) == 1 and c[0] not in a and journal_c != journal
    # a journal of another seed is refused, naming both sides, and left as it was
    with pytest.raises(ValueError, match=r"holds replies regenerated for other inputs or settings: seed: 1 there, "
                                         r"2 here\. Nothing was changed.*data.overwrite=true"):
        _synthesize(clean[0], "seed=2")
    assert (clean[0] / "data" / synth.JOURNAL).read_bytes() == journal


def _timing(report: dict) -> dict:
    return {k: report[k] for k in ("sampled_now", "generated_tokens", "seconds", "prompts_per_s", "tokens_per_s")}


def test_prepare_refuses_target_prompts_without_regeneration_or_limit(tmp_path):
    base = [f"run_dir={tmp_path / 'run'}", "target.device=cpu"]
    with pytest.raises(ValueError, match=r"data.sources\[0\] \(magpie\): format target_prompts writes user prompts "
                                         r"only; their replies come from regeneration: set data.regenerate=true"):
        prep.run(compose("tiny", [*base, SOURCE]))
    with pytest.raises(ValueError, match=r"format target_prompts needs limit: N, the number of prompts"):
        prep.run(compose("tiny", [*base, "data.regenerate=true", "data.sources=[{path: m, format: target_prompts}]"]))
    with pytest.raises(ValueError, match=r"data.synth_temperature=0.0 \(> 0: greedy"):
        compose("tiny", [*base, "data.synth_temperature=0"])
    assert not (tmp_path / "run" / "data").exists()


def test_synth_settings_enter_the_config_hash_only_with_a_target_prompts_source():
    plain = compose("tiny", [])
    sources = [[] for _ in plain.data.sources]
    assert prep.config_hash(plain, sources) == prep.config_hash(compose("tiny", ["data.synth_temperature=0.7"]), sources)
    magpie = compose("tiny", [SOURCE, "data.regenerate=true"])
    other = compose("tiny", [SOURCE, "data.regenerate=true", "data.synth_temperature=0.7"])
    described = [synth.describe(src) for src in magpie.data.sources]
    assert prep.config_hash(magpie, described) != prep.config_hash(other, described)


def _dataset_digest(data_dir: Path) -> dict:
    return {str(p.relative_to(data_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(data_dir.rglob("*")) if p.is_file() and p.name != "manifest.json"}


def _committed_batches(run_dir: Path) -> int:
    path = run_dir / "data" / synth.JOURNAL
    return max(0, len(path.read_bytes().split(b"\n")) - 2) if path.is_file() else 0  # whole lines after the header


def test_prepare_killed_while_sampling_resumes_to_the_same_prompts(tmp_path, clean, capsys):
    """A real `mtp-train prepare` killed with SIGKILL once a batch is committed; the rerun goes on from the journal
    and writes the journal and the dataset of an uninterrupted run, byte for byte."""
    import os
    import subprocess
    import sys
    import time

    import torch

    p = clean[1]["target_prompts"]
    assert (p["written"], p["requested"]) == (3, 3) and clean[1]["regenerate"]["conversations"] == 3
    assert clean[1]["sources"][0]["counts"]["kept"] == 3 and p["identity"]["seed"] == 1
    run_dir = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "mtp_train.cli", "prepare", f"run_dir={run_dir}", *SYNTH,
                                 SOURCE], cwd=Path(__file__).resolve().parents[1], env=env, stdout=subprocess.DEVNULL,
                                stderr=err)
        t0 = time.time()
        while _committed_batches(run_dir) < 1:
            assert proc.poll() is None and time.time() - t0 < 240, (tmp_path / "stderr").read_text()
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    killed = _committed_batches(run_dir)
    assert proc.returncode == -signal.SIGKILL and killed == 1  # of 2
    assert not (run_dir / "data" / "manifest.json").exists()
    capsys.readouterr()
    m = prep.run(compose("tiny", [f"run_dir={run_dir}", *SYNTH, SOURCE]))
    assert f"2 sampled prompts are in {run_dir / 'data' / synth.JOURNAL}; going on" in capsys.readouterr().out
    assert m["target_prompts"]["sampled_now"] == 2 and m["target_prompts"]["written"] == 3
    assert _dataset_digest(run_dir / "data") == _dataset_digest(clean[0] / "data")
    assert {synth.JOURNAL, "regenerate.jsonl"} <= set(_dataset_digest(run_dir / "data"))
    assert prep.run(compose("tiny", [f"run_dir={run_dir}", *SYNTH, SOURCE])) == m  # up to date
    assert "is up to date" in capsys.readouterr().out


def test_a_stop_request_ends_after_the_batch_in_flight(tmp_path, monkeypatch):
    """SIGTERM while a batch is sampled: the batch is committed, then Preempted (the command line exits 75)."""
    import os

    from mtp_train.preempt import Preempted

    decode = synth.decode_batches

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # deferred: recorded, honoured after the commit
        yield from decode(*args, **kwargs)

    monkeypatch.setattr(synth, "decode_batches", signalled)
    with pytest.raises(Preempted, match=r"prepare: stopped on request \(SIGTERM\) after the batch of prompts in "
                                        r"flight; 2 sampled prompts are committed to .*target_prompts.jsonl: the same "
                                        "command goes on from there"):
        _synthesize(tmp_path / "run")
    assert _committed_batches(tmp_path / "run") == 1
