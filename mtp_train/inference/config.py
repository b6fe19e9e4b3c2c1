"""The inference engine's settings: sampling, draft trees, `mtp-train generate` (`generate.*`) and the device profiles
of the speed model. Plain dataclasses and constants, no torch: the validate config and `mtp_train.config` build on
them."""

from __future__ import annotations

from dataclasses import dataclass, field

SPECULATIVE = ("head", "draft", "none")  # generate.speculative: the drafter


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    top_p: float = 1.0  # keep the smallest set of tokens with this much probability; 1 = all

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 is greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0 (0 keeps every token)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def tree_label(tree) -> str:
    """A TreeConfig or its (steps, topk, num_draft_tokens) as a report writes it -> "tree 5/4/8"."""
    if isinstance(tree, TreeConfig):
        tree = (tree.steps, tree.topk, tree.num_draft_tokens)
    return "tree " + "/".join(str(x) for x in tree)


@dataclass(frozen=True)
class TreeConfig:
    """SGLang's settings: `steps` drafter depths, `topk` branching, `num_draft_tokens` tokens verified per
    target forward, the pending token included (num_draft_tokens - 1 draft nodes)."""

    steps: int
    topk: int
    num_draft_tokens: int

    def __post_init__(self) -> None:
        for name in ("steps", "topk", "num_draft_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"tree.{name}={value!r}: expected an integer")
        if self.steps < 1:
            raise ValueError(f"tree.steps={self.steps}: must be >= 1 (the depth of the draft tree)")
        if self.topk < 1:
            raise ValueError(f"tree.topk={self.topk}: must be >= 1 (children per expanded node)")
        if not 2 <= self.num_draft_tokens <= 1 + self.max_nodes:
            raise ValueError(f"tree.num_draft_tokens={self.num_draft_tokens}: must be between 2 (the pending token "
                             f"and one draft) and 1 + {self.max_nodes}, the nodes that steps={self.steps}, "
                             f"topk={self.topk} generate (topk + (steps - 1) * topk^2)")

    @property
    def max_nodes(self) -> int:
        """Draft nodes the expansion generates: topk at depth 1, topk * topk at each later depth."""
        return self.topk + (self.steps - 1) * self.topk ** 2

    def shallower(self, steps: int) -> "TreeConfig":
        """The same tree at most `steps` deep (a batch whose rows are all close to their length limit)."""
        if steps >= self.steps:
            return self
        nodes = self.topk + (steps - 1) * self.topk ** 2  # the node budget shrinks with the depth
        return TreeConfig(steps, self.topk, min(self.num_draft_tokens, 1 + nodes))


@dataclass
class GenerateConfig:
    prompt: str = "Write `def is_palindrome(text)`.\n\nReturn True if text reads the same backwards."
    speculative: str = "head"  # head (run_dir/checkpoints/latest) | draft (target.draft_path) | none
    k: int = 4  # drafted tokens per target forward
    # a draft tree per step instead of the chain of k: [steps, topk, num_draft_tokens] as SGLang names them; [] = chain
    tree: list[int] = field(default_factory=list)
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_new_tokens: int = 128
    chat: bool = True  # wrap the prompt in the tokenizer's chat template when it has one

    def __post_init__(self) -> None:
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"generate.speculative={self.speculative!r}: expected one of {', '.join(SPECULATIVE)}")
        if self.k < 1:
            raise ValueError(f"generate.k={self.k}: must be >= 1 (the drafted tokens per target forward); "
                             "speculative=none decodes without drafting")
        if self.max_new_tokens < 1:
            raise ValueError(f"generate.max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.tree and len(self.tree) != 3:
            raise ValueError(f"generate.tree={list(self.tree)}: expected [steps, topk, num_draft_tokens] (or [] for a "
                             "chain of k drafts)")
        try:
            self.tree_config
        except ValueError as e:
            raise ValueError(f"generate.{e}") from None
        try:
            self.sampling
        except ValueError as e:
            raise ValueError(f"generate.{e}") from None

    @property
    def tree_config(self) -> TreeConfig | None:
        return TreeConfig(*map(int, self.tree)) if self.tree else None

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)


# ------------------------------------------------------------------------- device profiles of the speed model
# (inference/predict.py predicts a head's speed-up on them; validate.serving_profile names one)

BANDWIDTH_FRACTION = 4242 / 4800  # what the copy probe reached on an H200 (benchmarks/RESULTS.md `gpu`)


MATMUL_FRACTION = 782 / 989  # what an 8192^3 bf16 GEMM reached there


GRAPHS = {"fixed_ms": 0.3, "per_layer_ms": 0.03}  # assumed: an engine replaying CUDA graphs


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    bandwidth_gb_s: float  # achievable memory read bandwidth
    tflops: float  # achievable dense matmul rate at the dtype served (bf16 on GPUs, fp32 on a CPU)
    fixed_ms: float  # per forward, whatever its size
    per_layer_ms: float  # per decoder layer and forward (kernel launches)
    tile: int = 64  # matmul rows are padded to a multiple of this
    source: str = ""


def _gpu(name: str, tb_s: float, tflops: float, eager: dict | None = None) -> DeviceProfile:
    over = eager or GRAPHS
    return DeviceProfile(name, tb_s * 1000 * BANDWIDTH_FRACTION, tflops * MATMUL_FRACTION, over["fixed_ms"],
                         over["per_layer_ms"], 64,
                         f"datasheet {tb_s} TB/s, {tflops:g} TFLOP/s bf16 dense, times the fractions an H200 reached; "
                         + ("overhead measured: our eager runner on an H200" if eager else
                            "overhead assumed: an engine with CUDA graphs"))


# Our runner (eager transformers) on the H200: 8B forward ~19.5 ms at b <= 16 whatever n, one layer ~2.0 ms, of
# which weights are 3.8 and 0.35 ms: fixed + 32 x per_layer = 15.7, fixed + per_layer = 1.65.
H200_EAGER = {"fixed_ms": 1.2, "per_layer_ms": 0.45}


PROFILES = {p.name: p for p in (
    _gpu("H100-SXM", 3.35, 989), _gpu("H200", 4.8, 989), _gpu("A100-80GB", 2.039, 312), _gpu("L40S", 0.864, 362),
    DeviceProfile("H200-eager", 4.8 * 1000 * BANDWIDTH_FRACTION, 989 * MATMUL_FRACTION, H200_EAGER["fixed_ms"],
                  H200_EAGER["per_layer_ms"], 64, "measured: our eager runner on an H200 (benchmarks/gpu_forward_time.py)"),
)}
