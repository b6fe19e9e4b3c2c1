"""`mtp-train prepare`: exact assistant-only masks, every bad-input case with its message, determinism,
the plain-text path, self-distillation, and the recipe end to end."""

import hashlib
import json
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mtp_train.cli import main
from mtp_train.config import compose
from mtp_train.data import prepare as prep
from mtp_train.data import stdlib
from mtp_train.data.chat import BadRecord, has_generation_markers, normalize, tokenize_conversation
from mtp_train.data.sources import SourceConfig

CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "hi there"}, {"role": "user", "content": "Again, in Python."},
        {"role": "assistant", "content": "print('hello')\n"}]


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return AutoTokenizer.from_pretrained(tiny_dir / "target")


@pytest.fixture(scope="module")
def tok_plain(tiny_dir):
    """The same tokenizer with a template that has no {% generation %} markers."""
    t = AutoTokenizer.from_pretrained(tiny_dir / "target")
    t.chat_template = t.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert not has_generation_markers(t)
    return t


def _assistant_ids(tok, texts):
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    return [i for t in texts for i in tok(t, add_special_tokens=False)["input_ids"] + [eot]]


@pytest.mark.parametrize("which", ["tok", "tok_plain"])
def test_masks_are_exactly_the_assistant_turns(which, request):
    tok = request.getfixturevalue(which)
    t = tokenize_conversation(tok, CONV)
    assert t.input_ids == list(tok.apply_chat_template(CONV, tokenize=True, return_dict=False))
    assert [i for i, m in zip(t.input_ids, t.loss_mask) if m] == _assistant_ids(tok, ["hi there", "print('hello')\n"])
    assert tok.decode([i for i, m in zip(t.input_ids, t.loss_mask) if m]) == \
        "hi there<|eot_id|>print('hello')\n<|eot_id|>"
    last = tokenize_conversation(tok, CONV, last_turn_only=True)
    assert last.input_ids == t.input_ids
    assert [i for i, m in zip(last.input_ids, last.loss_mask) if m] == _assistant_ids(tok, ["print('hello')\n"])


def test_a_template_that_is_not_prefix_consistent_is_refused(tok_plain):
    t = AutoTokenizer.from_pretrained(tok_plain.name_or_path)
    # Drops the content of earlier assistant turns (as some "thinking" templates do).
    t.chat_template = ("{% for m in messages %}{{ m['role'] }}: "
                       "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}\n"
                       "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ValueError, match="does not render conversation prefixes as prefixes"):
        tokenize_conversation(t, CONV, where="x.jsonl:3")


@pytest.mark.parametrize("record, fmt, kind, message", [
    ({"messages": [{"role": "user", "content": "q"}]}, "openai", "no_assistant_turn", "no assistant turn"),
    ({"messages": []}, "openai", "empty_conversation", "field 'messages' is empty"),
    ({"conversation": []}, "sharegpt", "missing_field", "missing field 'conversations'"),
    ({"conversations": [{"from": "human"}]}, "sharegpt", "missing_field",
     "conversations[0] needs fields 'from' and 'value'"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "robot", "value": "a"}]}, "sharegpt",
     "unknown_role", "conversations[1].from is 'robot'"),
    ({"messages": [{"role": "user", "content": 3}]}, "openai", "missing_field",
     "field 'messages[0].content' must be a string"),
])
def test_normalize_names_the_field(record, fmt, kind, message):
    with pytest.raises(BadRecord) as e:
        normalize(record, fmt, "f.jsonl:7")
    assert e.value.kind == kind and str(e.value).startswith("f.jsonl:7: ") and message in str(e.value)


def test_normalize_sharegpt_and_openai_parts():
    sg = normalize({"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                                      {"from": "gpt", "value": "a"}]}, "sharegpt", "x")
    assert [m["role"] for m in sg] == ["system", "user", "assistant"]
    oa = normalize({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]},
                                 {"role": "assistant", "content": "c"}]}, "openai", "x")
    assert oa[0]["content"] == "ab"


def _cfg(tmp_path, sources, *overrides):
    cfg = compose("tiny", [f"run_dir={tmp_path / 'run'}", *overrides])
    cfg.data.sources = sources
    return cfg


def _write_jsonl(path: Path, lines) -> Path:
    path.write_bytes(b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n"
                              for line in lines))
    return path


GOOD = {"conversations": [{"from": "human", "value": "Write add."}, {"from": "gpt", "value": "def add(a, b): ..."}]}
BAD_LINES = [
    (b'{"conversations": [', "malformed_json", ":2: malformed JSON"),
    ({"nope": 1}, "missing_field", ":2: missing field 'conversations'"),
    ({"conversations": [{"from": "bot", "value": "x"}]}, "unknown_role", ":2: conversations[0].from is 'bot'"),
    ({"conversations": []}, "empty_conversation", ":2: field 'conversations' is empty"),
    ({"conversations": [{"from": "human", "value": "q"}]}, "no_assistant_turn", ":2: the conversation has no assistant"),
    (b'{"conversations": [{"from": "human", "value": "caf\xe9"}]}', "non_utf8", ":2: bytes that are not UTF-8"),
]


@pytest.mark.parametrize("line, kind, message", BAD_LINES, ids=[b[1] for b in BAD_LINES])
def test_bad_line_stops_the_run_naming_file_and_line(tmp_path, line, kind, message):
    path = _write_jsonl(tmp_path / "chats.jsonl", [GOOD, line, GOOD])
    cfg = _cfg(tmp_path, [SourceConfig(path=str(path), format="sharegpt", split="train")])
    with pytest.raises(ValueError) as e:
        prep.run(cfg)
    assert f"{path}{message}" in str(e.value) and "data.on_bad_line=skip" in str(e.value)
    assert not (tmp_path / "run" / "data").exists()


def test_bad_lines_are_counted_with_skip(tmp_path):
    path = _write_jsonl(tmp_path / "chats.jsonl", [GOOD] + [b[0] for b in BAD_LINES] + [
        {"conversations": [{"from": "human", "value": "other"}, {"from": "gpt", "value": "reply"}]}])
    cfg = _cfg(tmp_path, [SourceConfig(path=str(path), split="train")], "data.on_bad_line=skip")
    m = prep.run(cfg)
    counts = m["sources"][0]["counts"]
    assert {k: v for k, v in counts.items() if k.startswith("bad_")} == {f"bad_{b[1]}": 1 for b in BAD_LINES}
    assert counts["records"] == 2 and m["splits"]["train"]["samples"] == 2
    assert m["sources"][0]["files"] == [{"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}]


def test_json_list_and_format_detection_errors(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('[\n  {"conversations": []},\n  {oops}\n]')
    with pytest.raises(ValueError, match=rf"{broken}:3: malformed JSON"):
        prep.run(_cfg(tmp_path, [SourceConfig(path=str(broken), format="sharegpt", split="train")]))
    odd = tmp_path / "data.csv"
    odd.write_text("a,b\n")
    with pytest.raises(ValueError, match=r"data.csv: cannot tell the format from the suffix"):
        prep.run(_cfg(tmp_path, [SourceConfig(path=str(odd), split="train")]))
    neither = _write_jsonl(tmp_path / "x.jsonl", [{"text": "hi"}])
    with pytest.raises(ValueError, match=r"x.jsonl:1: cannot tell the format"):
        prep.run(_cfg(tmp_path, [SourceConfig(path=str(neither), split="train")]))


def test_missing_source_fails_before_any_work(tmp_path, capsys):
    assert main(["prepare", f"run_dir={tmp_path / 'run'}", "data.sources=[{path: /no/such.jsonl}]"]) == 1
    assert "data.sources[0]: path not found: /no/such.jsonl" in capsys.readouterr().err
    assert not (tmp_path / "run" / "data").exists()


def _dataset_digest(data_dir: Path, journal: bool = True) -> dict:
    skip = ("manifest.json",) if journal else ("manifest.json", "regenerate.jsonl")
    return {str(p.relative_to(data_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(data_dir.rglob("*")) if p.is_file() and p.name not in skip}


def test_same_inputs_give_a_byte_identical_dataset(tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i}"}]}
        for i in range(40)])
    runs = []
    for name in ("a", "b"):
        cfg = compose("tiny", [f"run_dir={tmp_path / name}", "data.val_fraction=0.25"])
        cfg.data.sources = [SourceConfig(path=str(path))]
        prep.run(cfg)
        runs.append(_dataset_digest(tmp_path / name / "data"))
    assert runs[0] == runs[1] and "train/data-00000-of-00001.arrow" in runs[0]
    m = json.loads((tmp_path / "a" / "data" / "manifest.json").read_text())
    assert m["splits"]["val"]["samples"] > 0 and m["splits"]["train"]["samples"] + m["splits"]["val"]["samples"] == 40


def test_plain_text_directory(tmp_path, tok):
    docs = tmp_path / "docs"
    docs.mkdir()
    files = stdlib.list_files("head-train")[:3]
    for f in files:
        (docs / Path(f.relpath).name).write_text(f.read())
    (docs / "__pycache__").mkdir()
    (docs / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\xff\xfe binary")  # not a text suffix: ignored
    (docs / ".hidden.txt").write_text("hidden files are skipped")
    cfg = _cfg(tmp_path, [SourceConfig(path=str(docs), split="train")], "data.max_length=64", "data.dedupe=false")
    m = prep.run(cfg)
    ds = datasets.load_from_disk(str(tmp_path / "run" / "data" / "train"))
    assert m["sources"][0]["counts"]["records"] == 3 and len(m["sources"][0]["files"]) == 3
    assert all(1 < len(r) <= 64 for r in ds["input_ids"]) and all(set(r) == {1} for r in ds["loss_mask"])
    expected = []  # each document as bos + text + eos, cut into 64-token chunks (a 1-token tail has no target)
    for f in files:
        ids = tok(f.read())["input_ids"] + [tok.eos_token_id]
        expected += [tuple(ids[i : i + 64]) for i in range(0, len(ids), 64) if len(ids[i : i + 64]) > 1]
    assert sorted(map(tuple, ds["input_ids"])) == sorted(expected)
    assert ds.features["input_ids"].feature.dtype == "int32" and ds.features["loss_mask"].feature.dtype == "int8"


def test_limit_weight_and_dedupe(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"q{i % 10}"}, {"role": "assistant", "content": "a"}]}
            for i in range(12)]  # two duplicates
    path = _write_jsonl(tmp_path / "c.jsonl", rows)
    m = prep.run(_cfg(tmp_path, [SourceConfig(path=str(path), split="train", limit=4, weight=2.5)]))
    c = m["sources"][0]["counts"]
    assert (c["records"], c["duplicates"], c["kept"], c["train_after_weight"]) == (12, 2, 4, 10)  # 4×2 + 2
    assert m["splits"]["train"]["samples"] == 10
    # Weights repeat training samples only.
    m = prep.run(_cfg(tmp_path, [SourceConfig(path=str(path), split="train"),
                                 SourceConfig(path=str(path), split="val", weight=3.0)],
                      "data.overwrite=true", "data.dedupe=false"))
    assert (m["splits"]["train"]["samples"], m["splits"]["val"]["samples"]) == (12, 12)


def test_overlong_truncate_and_drop(tmp_path):
    long = {"messages": [{"role": "user", "content": "x " * 200}, {"role": "assistant", "content": "y " * 200}]}
    path = _write_jsonl(tmp_path / "c.jsonl", [long])
    m = prep.run(_cfg(tmp_path, [SourceConfig(path=str(path), split="train")], "data.max_length=300"))
    assert m["counts"]["truncated"] == 1 and m["splits"]["train"]["tokens"] == 300
    with pytest.raises(ValueError, match="no training samples left"):
        prep.run(_cfg(tmp_path, [SourceConfig(path=str(path), split="train")], "data.max_length=300",
                      "data.overlong=drop", "data.overwrite=true"))


def test_an_edited_source_is_not_mistaken_for_up_to_date(tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", [GOOD])
    prep.run(_cfg(tmp_path, [SourceConfig(path=str(path), split="train")]))
    _write_jsonl(path, [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "NEW"}]}])
    with pytest.raises(ValueError, match="another config or other source files"):
        prep.run(_cfg(tmp_path, [SourceConfig(path=str(path), split="train")]))
    m = prep.run(_cfg(tmp_path, [SourceConfig(path=str(path), split="train")], "data.overwrite=true"))
    assert m["sources"][0]["files"][0]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_chatml_style_template_without_markers_masks_content_and_end_token_only(tok):
    t = AutoTokenizer.from_pretrained(tok.name_or_path)
    t.chat_template = ("{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '\n' + m['content'] + "
                       "'<|eot_id|>' + '\n' }}{% endfor %}"
                       "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant\n' }}{% endif %}")
    out = tokenize_conversation(t, CONV)
    assert [i for i, m in zip(out.input_ids, out.loss_mask) if m] == _assistant_ids(t, ["hi there", "print('hello')\n"])


def test_template_errors_follow_on_bad_line(tmp_path, tiny_dir):
    target = tmp_path / "target"
    target.mkdir()
    for f in (tiny_dir / "target").iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    strict = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
              "{{ m['role'] + ': ' + m['content'] + '<|eot_id|>' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    (target / "chat_template.jinja").write_text(strict)
    path = _write_jsonl(tmp_path / "c.jsonl", [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"},
                      {"role": "assistant", "content": "b"}]}])
    with pytest.raises(ValueError, match=rf"{path}:2: the chat template refused the conversation"):
        prep.run(_cfg(tmp_path, [SourceConfig(path=str(path), split="train")], f"target.path={target}"))
    m = prep.run(_cfg(tmp_path, [SourceConfig(path=str(path), split="train")], f"target.path={target}",
                      "data.on_bad_line=skip"))
    assert m["counts"]["bad_template_error"] == 1 and m["splits"]["train"]["samples"] == 1


def test_rerun_is_a_no_op_and_another_config_needs_overwrite(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "c.jsonl", [GOOD])
    prep.run(_cfg(tmp_path, [SourceConfig(path=str(path), split="train")]))
    before = _dataset_digest(tmp_path / "run" / "data")
    prep.run(_cfg(tmp_path, [SourceConfig(path=str(path), split="train")]))
    assert "is up to date" in capsys.readouterr().out
    with pytest.raises(ValueError, match="data.overwrite=true"):
        prep.run(_cfg(tmp_path, [SourceConfig(path=str(path), split="train")], "data.max_length=64"))
    assert _dataset_digest(tmp_path / "run" / "data") == before  # nothing lost
    prep.run(_cfg(tmp_path, [SourceConfig(path=str(path), split="train")], "data.max_length=64", "data.overwrite=true"))
    assert json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())["data_config"]["max_length"] == 64
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["data"]


def test_hf_disk_and_sharegpt_json_list(tmp_path):
    ds = datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": "q"},
                                                   {"role": "assistant", "content": "a"}]]})
    ds.save_to_disk(str(tmp_path / "hf"))
    (tmp_path / "sg.json").write_text(json.dumps([GOOD]))
    m = prep.run(_cfg(tmp_path, [SourceConfig(path=str(tmp_path / "hf"), split="train"),
                                 SourceConfig(path=str(tmp_path / "sg.json"), split="val")]))
    assert (m["splits"]["train"]["samples"], m["splits"]["val"]["samples"]) == (1, 1)


def test_regenerate_replaces_assistant_turns_with_the_targets_reply(tmp_path, tiny_dir, tok):
    convs = [{"messages": [{"role": "user", "content": f"Write `def f{i}(x)`.\n\nReturn x."},
                           {"role": "assistant", "content": "ORIGINAL"}]} for i in range(3)]
    path = _write_jsonl(tmp_path / "c.jsonl", convs)
    m = prep.run(_cfg(tmp_path, [SourceConfig(path=str(path), split="train")], "data.regenerate=true",
                      "data.regen_max_new_tokens=6", "data.regen_batch_size=2"))
    assert m["regenerate"]["conversations"] == 3 and m["regenerate"]["turns"] == 3
    target = AutoModelForCausalLM.from_pretrained(tiny_dir / "target", dtype=torch.float32)
    ds = datasets.load_from_disk(str(tmp_path / "run" / "data" / "train"))
    got = sorted(tok.decode([i for i, k in zip(ids, mask) if k]) for ids, mask in zip(ds["input_ids"], ds["loss_mask"]))
    expected = []
    for c in convs:
        prompt = torch.tensor([tok.apply_chat_template(c["messages"][:1], add_generation_prompt=True,
                                                       tokenize=True, return_dict=False)])
        out = target.generate(prompt, max_new_tokens=6, do_sample=False)[0, prompt.shape[1]:].tolist()
        stop = set(target.generation_config.eos_token_id)
        reply = out[: next((i for i, t in enumerate(out) if t in stop), len(out))]
        expected.append(tok.decode(reply, skip_special_tokens=True) + "<|eot_id|>")
    assert got == sorted(expected) and "ORIGINAL" not in "".join(got)


def test_regenerated_replies_are_reused_by_another_run_of_the_same_inputs(tmp_path, capsys):
    convs = [{"messages": [{"role": "user", "content": f"Write `def g{i}(x)`."},
                           {"role": "assistant", "content": "ORIGINAL"}]} for i in range(3)]
    path = _write_jsonl(tmp_path / "c.jsonl", convs)
    args = ("data.regenerate=true", "data.regen_max_new_tokens=6", "data.regen_batch_size=2", "data.regen_cache=true")
    first = prep.run(_cfg(tmp_path, [SourceConfig(path=str(path), split="train")], *args))
    cached = list((tmp_path / "data-cache" / "regenerated").glob("*.jsonl"))
    assert len(cached) == 1 and cached[0].read_bytes() == (tmp_path / "run" / "data" / "regenerate.jsonl").read_bytes()
    capsys.readouterr()
    other = tmp_path / "other"
    other.mkdir()
    again = prep.run(_cfg(other, [SourceConfig(path=str(path), split="train")], *args))
    assert "replies made before for these inputs" in capsys.readouterr().out
    assert again["token_ids_sha256"] == first["token_ids_sha256"]
    third = tmp_path / "third"
    third.mkdir()
    off = prep.run(_cfg(third, [SourceConfig(path=str(path), split="train")], *args[:-1], "data.regen_cache=false"))
    assert "replies made before" not in capsys.readouterr().out and off["token_ids_sha256"] == first["token_ids_sha256"]


def test_regenerate_multi_turn_feeds_the_targets_own_earlier_reply(tmp_path, tiny_dir, tok):
    conv = {"messages": [{"role": "user", "content": "Write `def a()`."}, {"role": "assistant", "content": "OLD1"},
                         {"role": "user", "content": "Now `def b()`."}, {"role": "assistant", "content": "OLD2"}]}
    path = _write_jsonl(tmp_path / "c.jsonl", [conv])
    prep.run(_cfg(tmp_path, [SourceConfig(path=str(path), split="train", weight=3.0)], "data.regenerate=true",
                  "data.regen_max_new_tokens=5"))
    m = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())
    assert m["regenerate"]["conversations"] == 1 and m["regenerate"]["turns"] == 2  # generated once, then weighted
    assert m["splits"]["train"]["samples"] == 3 and m["regenerate"]["samples_per_s"] > 0
    target = AutoModelForCausalLM.from_pretrained(tiny_dir / "target", dtype=torch.float32)
    stop = set(target.generation_config.eos_token_id)

    def reply(messages):
        prompt = torch.tensor([tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)])
        out = target.generate(prompt, max_new_tokens=5, do_sample=False)[0, prompt.shape[1]:].tolist()
        return tok.decode(out[: next((i for i, t in enumerate(out) if t in stop), len(out))], skip_special_tokens=True)

    msgs = [dict(x) for x in conv["messages"]]
    msgs[1]["content"] = reply(msgs[:1])
    msgs[3]["content"] = reply(msgs[:3])  # the second prompt holds the target's first reply
    ds = datasets.load_from_disk(str(tmp_path / "run" / "data" / "train"))
    assert ds[0]["input_ids"] == list(tok.apply_chat_template(msgs, tokenize=True, return_dict=False))


def test_tiny_recipe_end_to_end(tmp_path, tok):
    run_dir = tmp_path / "tiny"
    assert main(["prepare", f"run_dir={run_dir}", "data.sources.0.limit=4", "data.sources.1.limit=40",
                 "data.sources.2.limit=2", "data.sources.3.limit=8"]) == 0
    m = json.loads((run_dir / "data" / "manifest.json").read_text())
    assert m["tokenizer"]["sha256"] == prep.tokenizer_hash(Path(tok.name_or_path))
    assert m["sources"][1]["files"]["files"] == len(stdlib.list_files("head-train"))
    val = datasets.load_from_disk(str(run_dir / "data" / "val"))
    assert len(val) == m["splits"]["val"]["samples"] > 0
    # Every chat sample's masked tokens are one contiguous run right after the assistant header, and
    # decode to exactly that conversation's assistant text plus the end-of-turn token.
    answers = {conv[-1]["content"] for f in stdlib.list_files("validation")
               for conv in stdlib.function_conversations(f.read())}
    chats = [(ids, mask) for ids, mask in zip(val["input_ids"], val["loss_mask"]) if 0 in mask]
    complete = 0
    for ids, mask in chats:
        first = mask.index(1)
        assert all(mask[first:]) and not any(mask[:first])
        assert tok.decode(ids[:first]).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
        text = tok.decode(ids[first:])
        if text.endswith("<|eot_id|>"):  # not truncated
            assert text[: -len("<|eot_id|>")] in answers
            complete += 1
    assert complete > 0


class _StubOpenAI:
    """An OpenAI-compatible completions server on 127.0.0.1 (a thread): the reply names the prompt's length and
    seed; `fail` lists how many times each prompt length answers 503 first."""

    def __init__(self, fail: int = 0, always: int | None = None, hold_after: int | None = None, pad: int = 0):
        import http.server
        import threading

        stub = self
        self.requests, self.fail, self.always = [], fail, always
        self.hold_after, self.release = hold_after, threading.Event()  # requests past hold_after wait for release
        self.pad = pad  # characters added to each reply

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client was killed while it waited
                    pass

            def do_GET(self):
                self._send(200, {"data": [{"id": "tiny-target"}]} if self.path == "/v1/models" else {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append(body)
                if stub.hold_after is not None and len(stub.requests) > stub.hold_after:
                    stub.release.wait(60)
                if stub.always is not None:
                    return self._send(stub.always, {"error": "broken"})
                seen = sum(len(r["prompt"]) == len(body["prompt"]) for r in stub.requests)
                if seen <= stub.fail:
                    return self._send(503, {"error": "busy"})
                self._send(200, {"choices": [{"text": f"reply to {len(body['prompt'])} tokens, seed {body['seed']}"
                                                            + " x" * (stub.pad // 2)}],
                                 "usage": {"completion_tokens": 7}})

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()


def test_regenerate_through_an_openai_compatible_server(tmp_path, tok, monkeypatch):
    """data.regenerate_server: the prompts go to POST /completions as token ids with the chat template applied,
    the model named by GET /models, a transient 503 is retried, and the replies land in the dataset."""
    import mtp_train.data.regenerate as regen

    monkeypatch.setattr(regen.Server, "__init__", _fast_backoff(regen.Server.__init__))
    convs = [{"messages": [{"role": "user", "content": "q" * (i + 1)}, {"role": "assistant", "content": "ORIGINAL"}]}
             for i in range(3)]
    path = _write_jsonl(tmp_path / "c.jsonl", convs)
    stub = _StubOpenAI(fail=1)
    try:
        m = prep.run(_cfg(tmp_path, [SourceConfig(path=str(path), split="train")], "data.regenerate=true",
                          f"data.regenerate_server={stub.url}", "data.regen_max_new_tokens=9",
                          "data.regen_concurrency=2", "seed=5"))
    finally:
        stub.close()
    assert m["regenerate"]["engine"] == f"server {stub.url} (model tiny-target)"
    assert m["regenerate"]["turns"] == 3 and m["regenerate"]["generated_tokens"] == 21
    ok = stub.requests
    assert len(ok) == 6  # each prompt failed once (503) and was retried
    prompts = {tuple(tok.apply_chat_template(c["messages"][:1], add_generation_prompt=True, tokenize=True,
                                             return_dict=False)) for c in convs}
    assert {tuple(r["prompt"]) for r in ok} == prompts
    assert all(r["model"] == "tiny-target" and r["max_tokens"] == 9 and r["temperature"] == 0.0 for r in ok)
    ds = datasets.load_from_disk(str(tmp_path / "run" / "data" / "train"))
    texts = sorted(tok.decode(ids) for ids in ds["input_ids"])
    assert all("reply to" in t and "ORIGINAL" not in t for t in texts)
    assert {int(t.split("seed ")[1].split("<")[0]) for t in texts} == {5, 6, 7}  # the run's seed + conversation


def _fast_backoff(init):
    def fast(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.backoff = 0.01
    return fast


def test_regenerate_server_errors_write_nothing(tmp_path, monkeypatch):
    import socket

    import mtp_train.data.regenerate as regen

    monkeypatch.setattr(regen.Server, "__init__", _fast_backoff(regen.Server.__init__))
    path = _write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "q"},
                                                             {"role": "assistant", "content": "a"}]}])
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match=rf"data.regenerate_server=http://127.0.0.1:{port}/v1: cannot reach it"):
        prep.run(_cfg(tmp_path, [SourceConfig(path=str(path), split="train")], "data.regenerate=true",
                      f"data.regenerate_server=http://127.0.0.1:{port}/v1"))
    stub = _StubOpenAI(always=500)
    try:
        with pytest.raises(ValueError, match=r"the reply for .*c.jsonl:1, assistant turn 1 failed after 3 attempts "
                                             r"\(HTTP 500"):
            prep.run(_cfg(tmp_path, [SourceConfig(path=str(path), split="train")], "data.regenerate=true",
                          f"data.regenerate_server={stub.url}", "data.regen_retries=2"))
    finally:
        stub.close()
    assert len(stub.requests) == 3
    assert not (tmp_path / "run" / "data").exists()
    with pytest.raises(ValueError, match="expected an http"):
        _cfg(tmp_path, [], "data.regenerate_server=localhost:8000")


# -- regeneration that resumes ------------------------------------------------------------------------------
TWO_TURNS = [{"messages": [{"role": "user", "content": f"Write `def f{i}(x)`." + " x" * i},
                           {"role": "assistant", "content": "OLD1"}, {"role": "user", "content": "Again."},
                           {"role": "assistant", "content": "OLD2"}]} for i in range(6)]
REGEN = ["data.regenerate=true", "data.regen_batch_size=2", "data.regen_max_new_tokens=4",
         "data.regen_temperature=0.8"]  # sampled: each batch's seed must not depend on where the run started


def _journal_replies(run_dir: Path) -> int:
    path = run_dir / "data" / "regenerate.jsonl"
    if not path.is_file():
        return 0
    lines = path.read_bytes().split(b"\n")[1:-1]  # whole lines after the header
    return sum(len(json.loads(line)["replies"]) for line in lines)


def _start_prepare(run_dir: Path, source: Path, *overrides: str):
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "mtp_train.cli", "prepare", f"run_dir={run_dir}",
                             f"data.sources=[{{path: {source}, split: train}}]", *overrides],
                            cwd=Path(__file__).resolve().parents[1], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_until(proc, holds, what: str, timeout: float = 240) -> None:
    """Poll `holds()` while `proc` runs; fails if it ends first or `what` has not happened in `timeout` s."""
    import time

    t0 = time.time()
    while not holds():
        assert proc.poll() is None, proc.communicate()
        if time.time() - t0 > timeout:
            raise TimeoutError(f"{what}: not in {timeout}s")
        time.sleep(0.01)


def _interrupt(run_dir: Path, source: Path, overrides, sig, at: int, then=lambda: None, sent=lambda: True):
    """A real `mtp-train prepare` sent `sig` once `at` replies are committed and `sent()` holds (`then` runs after
    the signal): -> (exit status, stdout, stderr, replies committed when it ended)."""
    proc = _start_prepare(run_dir, source, *overrides)
    _wait_until(proc, lambda: _journal_replies(run_dir) >= at, f"{at} replies committed")
    # e.g. the requests that follow have reached the server, not only been queued
    _wait_until(proc, sent, "the condition before the signal", timeout=60)
    proc.send_signal(sig)
    then()
    out, err = proc.communicate(timeout=120)
    assert not (run_dir / "data" / "manifest.json").exists()
    return proc.returncode, out, err, _journal_replies(run_dir)


def _finish(run_dir: Path, source: Path, overrides) -> dict:
    cfg = compose("tiny", [f"run_dir={run_dir}", *overrides])
    cfg.data.sources = [SourceConfig(path=str(source), split="train")]
    return prep.run(cfg)


def test_regeneration_killed_and_stopped_resumes_to_the_same_dataset(tmp_path, capsys):
    """Our engine, in a real `mtp-train prepare`: SIGKILL mid-round; started again, SIGTERM (the batch in flight
    finished and committed, exit 75); then the rest in this process: the dataset and the journal equal an
    uninterrupted run's, byte for byte, with sampled replies."""
    import signal

    source = _write_jsonl(tmp_path / "c.jsonl", TWO_TURNS)
    _finish(tmp_path / "clean", source, REGEN)
    run_dir, journal = tmp_path / "stopped", tmp_path / "stopped" / "data" / "regenerate.jsonl"
    rc, _, _, killed = _interrupt(run_dir, source, REGEN, signal.SIGKILL, at=2)
    assert rc == -signal.SIGKILL and 2 <= killed < 12
    rc, out, err, stopped = _interrupt(run_dir, source, REGEN, signal.SIGTERM, at=killed + 2)
    assert rc == 75, err
    assert f"{killed} of 12 regenerated replies are in {journal}; going on from there" in out
    assert "SIGTERM received: stopping after the batch of replies in flight" in err
    assert f"prepare: stopped on request (SIGTERM) after the batch in flight; {stopped} regenerated replies are " \
           f"committed to {journal}: the same command goes on from there" in err
    assert killed + 2 <= stopped < 12 and stopped % 2 == 0  # whole batches of 2
    capsys.readouterr()
    m = _finish(run_dir, source, REGEN)
    assert m["regenerate"]["turns_from_journal"] == stopped and m["regenerate"]["turns"] == 12
    assert _dataset_digest(run_dir / "data") == _dataset_digest(tmp_path / "clean" / "data")
    assert "regenerate.jsonl" in _dataset_digest(run_dir / "data")
    assert _finish(run_dir, source, REGEN) == m and "is up to date" in capsys.readouterr().out


def test_regeneration_through_a_server_killed_and_stopped_resumes(tmp_path):
    """data.regenerate_server: the stub answers 4 requests, then holds the next: SIGKILL there. Started again
    against another server (another port), 2 answered, 2 held: SIGTERM, then the held ones are let through and
    committed, the 4 not sent yet are never sent, exit 75. The rest asks only for the 4 turns the journal lacks,
    and the dataset equals an uninterrupted run's."""
    import signal
    import time

    source = _write_jsonl(tmp_path / "c.jsonl", TWO_TURNS)
    over = ["data.regenerate=true", "data.regen_concurrency=2"]
    stubs = [_StubOpenAI(), _StubOpenAI(hold_after=4), _StubOpenAI(hold_after=2), _StubOpenAI()]
    try:
        _finish(tmp_path / "clean", source, [*over, f"data.regenerate_server={stubs[0].url}"])
        run_dir = tmp_path / "stopped"
        rc, _, _, killed = _interrupt(run_dir, source, [*over, f"data.regenerate_server={stubs[1].url}"],
                                      signal.SIGKILL, at=4)
        assert rc == -signal.SIGKILL and killed == 4

        def let_through():
            time.sleep(1.0)  # the signal is in before the held requests answer
            stubs[2].release.set()

        # the signal waits for the 2 held requests to reach the server: one still queued in our pool when the
        # signal lands is dropped (never sent), which is right but would commit 7
        rc, out, err, stopped = _interrupt(run_dir, source, [*over, f"data.regenerate_server={stubs[2].url}"],
                                           signal.SIGTERM, at=6, then=let_through,
                                           sent=lambda: len(stubs[2].requests) == 4)
        assert rc == 75, err
        assert "after the requests in flight; 8 regenerated replies are committed" in err
        assert stopped == 8 and len(stubs[2].requests) == 4  # 2 answered, 2 in flight; nothing sent after
        m = _finish(run_dir, source, [*over, f"data.regenerate_server={stubs[3].url}"])
    finally:
        for stub in stubs:
            stub.close()
    assert m["regenerate"]["turns_from_journal"] == 8 and len(stubs[3].requests) == 4
    assert _dataset_digest(run_dir / "data", journal=False) == _dataset_digest(tmp_path / "clean" / "data",
                                                                               journal=False)


def _left_by_a_killed_run(data_dir: Path) -> None:
    """What a prepare killed during regeneration leaves: the journal alone."""
    import shutil

    for p in data_dir.iterdir():
        if p.name != "regenerate.jsonl":
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def test_a_journal_cut_short_drops_its_last_line_and_goes_on(tmp_path, capsys):
    source = _write_jsonl(tmp_path / "c.jsonl", TWO_TURNS)
    stub = _StubOpenAI()
    try:
        over = ["data.regenerate=true", "data.regen_concurrency=1", f"data.regenerate_server={stub.url}"]
        _finish(tmp_path / "run", source, over)
        data = tmp_path / "run" / "data"
        whole, before = (data / "regenerate.jsonl").read_bytes(), _dataset_digest(data)
        _left_by_a_killed_run(data)
        (data / "regenerate.jsonl").write_bytes(whole[:-7])  # killed while the last commit was written
        stub.requests.clear()
        m = _finish(tmp_path / "run", source, over)
    finally:
        stub.close()
    lines = whole.split(b"\n")[:-1]
    last = len(json.loads(lines[-1])["replies"])  # the replies that finished together, committed together
    assert f"regenerate.jsonl:{len(lines)}: dropping a last line cut short" in capsys.readouterr().out
    assert m["regenerate"]["turns_from_journal"] == 12 - last and len(stub.requests) == last
    # the same replies and dataset; not the same bytes: replies that finish together are committed together, and
    # which do depends on timing (a loaded machine can see two of the sequential requests finish in one wake-up)
    again = (data / "regenerate.jsonl").read_bytes().split(b"\n")[:-1]
    assert again[0] == lines[0] and _replies(again[1:]) == _replies(lines[1:]) and _dataset_digest(data) == before


def _replies(lines: list[bytes]) -> list:
    """A journal's committed replies in order, whatever lines they were committed in."""
    return [r for line in lines for r in json.loads(line)["replies"]]


def test_a_journal_of_other_inputs_or_settings_is_refused_naming_both_sides(tmp_path, capsys):
    a = _write_jsonl(tmp_path / "a.jsonl", TWO_TURNS)
    b = _write_jsonl(tmp_path / "b.jsonl", TWO_TURNS[:3])
    stub = _StubOpenAI()
    try:
        over = ["data.regenerate=true", f"data.regenerate_server={stub.url}"]
        _finish(tmp_path / "run", a, [*over, "data.regen_max_new_tokens=9"])
        data = tmp_path / "run" / "data"
        _left_by_a_killed_run(data)
        journal = (data / "regenerate.jsonl").read_bytes()
        with pytest.raises(ValueError) as e:
            _finish(tmp_path / "run", b, [*over, "data.regen_max_new_tokens=5"])
        msg = str(e.value)
        assert msg.startswith(f"{data / 'regenerate.jsonl'} holds replies regenerated for other inputs or settings")
        assert f"6 conversations (sha256 " in msg and f") from {a} there, 3 conversations (sha256 " in msg
        assert f") from {b} here" in msg
        assert 'sampling: {"max_new_tokens": 9, "temperature": 0.0} there, {"max_new_tokens": 5, ' in msg
        assert "target" not in msg and "seed" not in msg and "data.overwrite=true" in msg
        assert (data / "regenerate.jsonl").read_bytes() == journal and not stub.requests[12:]  # nothing changed
        with pytest.raises(ValueError, match=r"seed: 0 there, 1 here"):
            _finish(tmp_path / "run", a, [*over, "data.regen_max_new_tokens=9", "seed=1"])
        m = _finish(tmp_path / "run", b, [*over, "data.regen_max_new_tokens=5", "data.overwrite=true"])
    finally:
        stub.close()
    assert "data.overwrite=true: discarding" in capsys.readouterr().out
    assert m["regenerate"]["turns_from_journal"] == 0 and m["regenerate"]["turns"] == 6


def test_sigterm_while_the_target_loads_for_regeneration_exits_75(tmp_path):
    from stops import signalled_run

    source = _write_jsonl(tmp_path / "c.jsonl", TWO_TURNS[:2])
    run_dir = tmp_path / "run"
    done = signalled_run(["prepare", f"run_dir={run_dir}", f"data.sources=[{{path: {source}, split: train}}]",
                          *REGEN], "mtp_train.data.regenerate:load_runner")
    assert done.returncode == 75, done.stderr
    assert "prepare: stopped on request (SIGTERM) outside a batch of replies (reading, loading the target, " \
           "tokenizing), at once: nothing was being written" in done.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "PREEMPTED", "config.yaml"]  # no data
    assert (run_dir / ".lock").read_text() == ""
    assert (run_dir / "PREEMPTED").read_text().startswith("prepare: stopped on request (SIGTERM)")
    assert main(["prepare", f"run_dir={run_dir}", f"data.sources=[{{path: {source}, split: train}}]", *REGEN]) == 0
    assert not (run_dir / "PREEMPTED").exists()  # the rerun that went on honoured it


def test_preparing_again_with_settings_that_keep_the_replies_reuses_the_journal(tmp_path):
    source = _write_jsonl(tmp_path / "c.jsonl", TWO_TURNS)
    stub = _StubOpenAI()
    try:
        over = ["data.regenerate=true", f"data.regenerate_server={stub.url}"]
        _finish(tmp_path / "run", source, over)
        asked = len(stub.requests)
        m = _finish(tmp_path / "run", source, [*over, "data.max_length=40", "data.overwrite=true"])
    finally:
        stub.close()
    assert asked == 12 and len(stub.requests) == 12  # nothing asked again
    assert m["regenerate"]["turns_from_journal"] == 12 and m["counts"]["truncated"] > 0
    assert (tmp_path / "run" / "data" / "regenerate.jsonl").is_file()


def test_decontaminate_drops_conversations_that_overlap_held_out_prompts(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_TRAIN_PROMPTS", str(tmp_path / "no-prompts"))  # MT-bench not fetched: unchecked
    held = ["Explain how a transistor amplifies a signal, step by step, for a beginner.",
            "Write a short poem about the sea in the style of a pirate."]
    dev_file = _write_jsonl(tmp_path / "dev.jsonl", [{"turns": [held[0]]}])
    test_file = _write_jsonl(tmp_path / "test.jsonl", [{"turns": [held[1]]}])
    convs = [{"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "a reply"}]}
             for text in ["Please: " + held[0].upper(), "What is the capital of France?",
                          "write a short poem about the sea in the style of a pirate, with rhymes"]]
    source = _write_jsonl(tmp_path / "c.jsonl", convs)
    cfg = _cfg(tmp_path, [SourceConfig(path=str(source), split="train")], "data.decontaminate=true",
               f"validate.prompts=[recipe,{dev_file}]", f"validate.test_prompts=[{test_file},mt-bench-test]")
    m = prep.run(cfg)
    d = m["decontaminate"]
    assert d["dropped"] == 2 and d["dropped_by_source"] == {0: 2}
    assert d["checked"] == [str(dev_file), str(test_file)] and d["unchecked"] == ["mt-bench-test"]
    assert any("contained 100%" in e and "dev.jsonl" in e for e in d["examples"])
    assert m["splits"]["train"]["samples"] == 1
    plain = prep.run(_cfg(tmp_path / "p", [SourceConfig(path=str(source), split="train")]))
    assert "decontaminate" not in plain and plain["splits"]["train"]["samples"] == 3
