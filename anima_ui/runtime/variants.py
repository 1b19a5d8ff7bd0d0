"""The ways the board can run a branch kind (variants) and the choice of one per kind (a plan).

A variant says which graph set it runs (batch-1 graphs: cond and uncond as two calls or on two chains; batch-2
graphs: one call for both), on how many chains, with or without prefetching, on which NPU cores. Self-attention,
cross-attention and the FFN may each prefer a different one: `anima-ui tune` measures them on the board and
writes the choice into a profile, `--variant` picks them by hand."""

from dataclasses import dataclass, field

from anima_ui.errors import UserError
from anima_ui.model.config import BRANCH_KINDS
from anima_ui.runtime.backends import check_core_mask


@dataclass(frozen=True)
class Variant:
    name: str
    graph_batch: int  # the graph set it runs
    chains: int  # 2: cond and uncond each on its own chain of contexts, meeting at the CFG combine
    prefetch: bool
    core_masks: tuple[str, ...]  # one per chain; () = the --core-mask flag's (default auto)
    about: str


VARIANTS = {v.name: v for v in (
    Variant("serial", 1, 1, False, (), "the blog's loop: load, init, run cond and uncond, release, one graph at a time"),
    Variant("prefetch", 1, 1, True, (), "a thread keeps the next K contexts open and releases the ones behind"),
    Variant("two-chains", 1, 2, True, ("0", "1"),
            "cond on NPU core 0, uncond on core 1: each chain its own prefetch, contexts and host thread"),
    Variant("batch2", 2, 1, True, ("0",), "batch-2 graphs, one call for cond and uncond, on core 0"),
    Variant("batch2-0_1", 2, 1, True, ("0_1",), "batch-2 graphs on cores 0 and 1 (core_mask 0_1)"),
    Variant("batch2-0_1_2", 2, 1, True, ("0_1_2",), "batch-2 graphs on cores 0, 1 and 2 (core_mask 0_1_2)"),
    Variant("batch1-0_1_2", 1, 1, True, ("0_1_2",), "batch-1 graphs, cond and uncond as two calls on cores 0, 1 and 2"),
)}


@dataclass
class Plan:
    """The variant of each branch kind, and what every prefetching runner shares."""

    variants: dict[str, str] = field(default_factory=lambda: dict.fromkeys(BRANCH_KINDS, "prefetch"))
    contexts: int = 2  # K: contexts each prefetching runner keeps open
    core_mask: str = "auto"  # for the variants without cores of their own (serial, prefetch)
    wait_for_inference: bool = False  # init and release wait until no inference runs (first-run safety)

    def __post_init__(self):
        for kind, name in self.variants.items():
            if kind not in BRANCH_KINDS:
                raise UserError(f"unknown branch kind {kind!r}: the kinds are {', '.join(BRANCH_KINDS)}")
            if name not in VARIANTS:
                raise UserError(f"unknown variant {name!r} for {kind}: choose one of {', '.join(VARIANTS)}")
        missing = [kind for kind in BRANCH_KINDS if kind not in self.variants]
        if missing:
            raise UserError(f"the plan names no variant for {', '.join(missing)}")
        check_core_mask(self.core_mask)
        if self.contexts < 2 and any(VARIANTS[n].prefetch for n in self.variants.values()):
            raise UserError(f"--max-contexts {self.contexts}: prefetching needs at least 2 contexts (or use --variant serial)")

    @classmethod
    def uniform(cls, name: str, **options) -> "Plan":
        return cls(dict.fromkeys(BRANCH_KINDS, name), **options)

    def variant(self, kind: str) -> Variant:
        return VARIANTS[self.variants[kind]]

    def graph_batches(self) -> set[int]:
        return {self.variant(kind).graph_batch for kind in BRANCH_KINDS}

    def has_chains(self) -> bool:
        return any(self.variant(kind).chains == 2 for kind in BRANCH_KINDS)

    def describe(self) -> str:
        names = set(self.variants.values())
        chosen = names.pop() if len(names) == 1 else ", ".join(f"{kind} {self.variants[kind]}" for kind in BRANCH_KINDS)
        extra = [f"K={self.contexts}"] if any(self.variant(k).prefetch for k in BRANCH_KINDS) else []
        if self.core_mask != "auto" and any(not self.variant(k).core_masks for k in BRANCH_KINDS):
            extra.append(f"core mask {self.core_mask}")
        if self.wait_for_inference:
            extra.append("init/release wait for inference")
        return chosen + (f" ({', '.join(extra)})" if extra else "")


def parse_variants(text: str) -> dict[str, str]:
    """`--variant NAME` (every kind) or `--variant self_attn=NAME,mlp=NAME` (the kinds not named keep prefetch)."""
    if "=" not in text:
        return dict.fromkeys(BRANCH_KINDS, text.strip())
    chosen = dict.fromkeys(BRANCH_KINDS, "prefetch")
    for item in text.split(","):
        kind, _, name = item.partition("=")
        if kind.strip() not in BRANCH_KINDS:
            raise UserError(f"--variant {text!r}: {kind.strip()!r} is not a branch kind ({', '.join(BRANCH_KINDS)})")
        chosen[kind.strip()] = name.strip()
    return chosen
