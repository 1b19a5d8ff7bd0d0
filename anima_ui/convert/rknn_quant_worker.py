"""Runs inside .venv-rknn (rknn-toolkit2 2.5.0), started by anima_ui/quant/convert.py; it imports nothing from
anima_ui, whose environment it cannot share, but shares rknn_worker.py's toolkit import (with its torch stand-in)
and parent-death hook from this folder. One job per process, described by a JSON file:

  mode "hybrid": config(w8a8, per-channel) -> load_onnx -> hybrid_quantization_step1 -> text-edit the
      .quantization.cfg (listed tensors to float16, activation ranges overwritten) -> hybrid_quantization_step2
  mode "int8":   the toolkit's own full W8A8 build (its min/max calibration), for comparison
  mode "fp16":   the FP16 build the project ships today
then export_rknn and, in the same session (the simulator cannot run a loaded .rknn), the simulator on the
job's check inputs, whose outputs are saved as .npy.

The .cfg is edited as text: a YAML round-trip rewrites the scale/zero-point fields, which step 2 then
rejects ("... is not allowed to be modified!"). Only min/max may change, and the toolkit recomputes the
scale and zero point from them; step 2 accepts edited ranges only under the "normal" algorithm ("Not support
modify quantize_parameters when config.quantized_algorithm = mmse", the same for kl_divergence), so the
ranges are searched on the host instead. Initializers and graph inputs may not be listed in custom_quantize_layers.

torch: this path touches only `torch.no_grad` (the toolkit's import-time decorator), checked by running it with
a recording stand-in for torch; the real torch is not needed for W8A8 with the "normal" algorithm, so
rknn_worker.import_rknn's stand-in serves here too.

The toolkit's build log (with RKNN_LOG_LEVEL=5 its op table: type, dtype and modelled cycles per op) goes
to this process's stdout/stderr, which the caller keeps; the result is written to the job's result file."""

import importlib.metadata
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from rknn_worker import die_with_parent, import_rknn  # this script's folder is first on sys.path

RKNN = import_rknn()

TENSOR_LINE = re.compile(r"^    (\S+):\s*$")
BOUND_LINE = re.compile(r"^        (min|max):\s*$")


def matches(name: str, prefix: str) -> bool:
    """The toolkit derives tensor names from ONNX ones: h -> h_rs, h_tp-rs, h_int8; res1 -> res1_mm; mid -> mid_tp#1-rs."""
    return name == prefix or (name.startswith(prefix) and name[len(prefix)] in "_-#")


def edit_cfg(text: str, float16: list[str], ranges: dict) -> str:
    lines = text.split("\n")
    if not lines[0].startswith("custom_quantize_layers:"):
        raise RuntimeError(f"unexpected first line of the quantization cfg: {lines[0]!r}")
    lines[0] = "custom_quantize_layers: {" + ", ".join(f"'{name}': float16" for name in float16) + "}"
    current, index = None, 1
    while index < len(lines):
        line = lines[index]
        tensor = TENSOR_LINE.match(line)
        if tensor:
            current = next((p for p in ranges if matches(tensor.group(1), p)), None)
        bound = BOUND_LINE.match(line)
        if bound and current is not None:
            value = ranges[current][0 if bound.group(1) == "min" else 1]
            if not lines[index + 1].lstrip().startswith("-"):
                raise RuntimeError(f"unexpected {bound.group(1)} entry in the quantization cfg: {lines[index + 1]!r}")
            lines[index + 1] = f"        -   {float(value)!r}"
            index += 1
        index += 1
    return "\n".join(lines)


def cfg_tensors(text: str) -> list[str]:
    return [m.group(1) for line in text.split("\n") if (m := TENSOR_LINE.match(line))]


def check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed (the toolkit's log above says why)")


def dataset_file(paths: list[str], folder: Path) -> str:
    listing = folder / "dataset.txt"
    listing.write_text("".join(f"{p}\n" for p in paths))
    return str(listing)


def build(job: dict, work: Path) -> tuple[RKNN, dict]:
    onnx_path = job["onnx"]
    info = {}
    if job["mode"] == "hybrid":
        rknn = RKNN(verbose=False)
        rknn.config(target_platform=job["target"], quantized_dtype="w8a8", quantized_method="channel", quantized_algorithm="normal")
        check(rknn.load_onnx(model=onnx_path), "load_onnx")
        check(rknn.hybrid_quantization_step1(dataset=dataset_file(job["dataset"], work), proposal=False), "hybrid_quantization_step1")
        rknn.release()
        stem = Path(onnx_path).stem
        cfg_path = work / f"{stem}.quantization.cfg"
        text = cfg_path.read_text()
        graph = onnx.load(onnx_path, load_external_data=False).graph
        not_listable = {i.name for i in graph.initializer} | {i.name for i in graph.input}
        names = cfg_tensors(text)
        float16 = [n for n in names if n not in not_listable and not any(matches(n, p) for p in job["int8_prefixes"])]
        edited = work / f"{stem}.edited.cfg"
        edited.write_text(edit_cfg(text, float16, job["ranges"]))
        info.update(cfg_tensors=names, float16=float16,
                    ranges_applied={n: p for n in names for p in job["ranges"] if matches(n, p)})
        rknn = RKNN(verbose=True)
        check(rknn.hybrid_quantization_step2(str(work / f"{stem}.model"), str(work / f"{stem}.data"), str(edited)),
              "hybrid_quantization_step2")
        return rknn, info
    rknn = RKNN(verbose=True)
    if job["mode"] == "int8":
        rknn.config(target_platform=job["target"], quantized_dtype="w8a8", quantized_method="channel", quantized_algorithm="normal")
        check(rknn.load_onnx(model=onnx_path), "load_onnx")
        check(rknn.build(do_quantization=True, dataset=dataset_file(job["dataset"], work)), "build")
    else:
        rknn.config(target_platform=job["target"], float_dtype="float16")
        check(rknn.load_onnx(model=onnx_path), "load_onnx")
        check(rknn.build(do_quantization=False), "build")
    return rknn, info


def main() -> int:
    die_with_parent()
    job = json.loads(Path(sys.argv[1]).read_text())
    work = Path(job["work"])
    os.chdir(work)  # hybrid step 1 writes its .model/.data/.cfg into the current folder
    started = time.perf_counter()
    rknn, info = build(job, work)
    try:
        check(rknn.export_rknn(job["rknn"]), "export_rknn")
        build_seconds = time.perf_counter() - started
        outputs = []
        if job.get("check_inputs"):
            check(rknn.init_runtime(), "simulator init_runtime")  # target=None: the simulator
            for index, path in enumerate(job["check_inputs"]):
                out = np.asarray(rknn.inference(inputs=[np.load(path)])[0], np.float32)
                target = Path(job["check_outputs_dir"]) / f"sim_{index:02d}.npy"
                np.save(target, out)
                outputs.append(str(target))
    finally:
        rknn.release()
    result = {"toolkit": importlib.metadata.version("rknn-toolkit2"), "build_seconds": round(build_seconds, 2),
              "sim_outputs": outputs, **info}
    Path(job["result"]).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
