"""The tune profile (`tune.json` in a graphs folder, written by `anima-ui tune`): the variant each branch kind
runs fastest with while matching the serial result, what every variant measured, and the faster correct final
decoder at that size. `serve` and `generate` read it unless told `--no-tune-profile`."""

import json
from dataclasses import dataclass
from pathlib import Path

from anima_ui.errors import UserError
from anima_ui.files import write_atomically
from anima_ui.model.config import BRANCH_KINDS
from anima_ui.runtime.variants import VARIANTS, Plan

PROFILE = "tune.json"
FORMAT = 1


@dataclass
class Profile:
    path: Path
    data: dict

    @property
    def backend(self) -> str:
        return self.data["backend"]

    @property
    def created(self) -> str:
        return self.data["created"]

    @property
    def decoder(self) -> str | None:
        return (self.data.get("decoder") or {}).get("chosen")

    @property
    def ffn(self) -> str | None:
        """"w8a8-lowrank" when tune found the installed quantized FFNs faster and correct, "fp16" when not, None
        when the graphs had none."""
        return (self.data.get("ffn") or {}).get("chosen")

    def summary(self) -> str:
        """One line: the size, the choice per kind, the decoder, when and where it was measured."""
        names = set(self.data["choice"].values())
        chosen = names.pop() if len(names) == 1 else ", ".join(f"{k} {self.data['choice'][k]}" for k in BRANCH_KINDS)
        decoder = f", decoder {self.decoder}" if self.decoder else ""
        ffn = f", FFNs {self.ffn}" if self.ffn else ""
        return f"{self.data['width']}x{self.data['height']}: {chosen}{ffn}{decoder} ({self.path}, {self.created})"

    def plan(self, graph_batches: set[int], **options) -> tuple[Plan, list[str]]:
        """The profile's plan with the graph sets present (`graph_batches`). A kind whose choice needs a missing
        set runs the fastest correct variant measured with the sets present; the notes say which and why."""
        variants, notes = {}, []
        for kind in BRANCH_KINDS:
            chosen = self.data["choice"][kind]
            if VARIANTS[chosen].graph_batch in graph_batches:
                variants[kind] = chosen
                continue
            measured = self.data["measured"][kind]
            usable = [name for name, m in measured.items() if "median_seconds" in m and VARIANTS[name].graph_batch in graph_batches]
            variants[kind] = min(usable, key=lambda name: measured[name]["median_seconds"]) if usable else "prefetch"
            notes.append(f"{kind}: the profile's {chosen} needs batch-{VARIANTS[chosen].graph_batch} graphs, which are not "
                         f"exported; running {variants[kind]} (`anima-ui export --batch {VARIANTS[chosen].graph_batch}` makes them)")
        options.setdefault("contexts", self.data.get("contexts", 2))
        return Plan(variants, **options), notes


def read_profile(folder) -> Profile | None:
    path = Path(folder, PROFILE)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or set(data["choice"]) != set(BRANCH_KINDS) or not set(data["choice"].values()) <= set(VARIANTS):
            raise ValueError("unknown format or variant")
        data["measured"], data["backend"], data["created"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{path} is damaged ({exc}); run `anima-ui tune` again or pass --no-tune-profile") from None
    return Profile(path, data)


def find_profiles(models_dir, backend: str) -> list[Profile]:
    """The readable profiles of `backend` in a model folder's graph folders (exported/* or rknn/*)."""
    found = []
    for path in sorted(Path(models_dir, "rknn" if backend == "rknn" else "exported").glob(f"*/{PROFILE}")):
        try:
            profile = read_profile(path.parent)
        except UserError:
            continue  # a damaged one is reported when a generation at its size reads it
        if profile.backend == backend:
            found.append(profile)
    return found


def write_profile(folder, data: dict) -> Path:
    """Atomically: a reader sees the old profile, none, or the whole new one."""
    path = Path(folder, PROFILE)
    text = json.dumps({"format": FORMAT, **data}, indent=1, allow_nan=False) + "\n"  # strict JSON: no Infinity/NaN
    write_atomically(path, lambda f: f.write(text.encode()))
    return path
