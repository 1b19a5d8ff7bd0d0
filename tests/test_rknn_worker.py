"""The conversion worker without the toolkit: the torch stand-in it installs when .venv-rknn has no torch, and the
op table read from a build log."""

import pytest

from anima_ui.convert.rknn_worker import parse_op_table, placement, torch_stand_in

# An op table in the layout rknn-toolkit2 2.5.0 prints (verbose), rows written for this test: one op on the CPU besides
# the input and output, and a line after the table that looks like a row.
BUILD_LOG = """\
I RKNN: [10:01:02.003] some other line 1 2 3
D RKNN: [10:01:02.004]                        Network Layer Information Table
D RKNN: [10:01:02.004] ------------------------------------------------------------------------------------------------------------------
D RKNN: [10:01:02.004] ID   OpType           DataType Target InputShape                  OutputShape       Cycles(DDR/NPU/Total)    RW(KB)       FullName
D RKNN: [10:01:02.004] ------------------------------------------------------------------------------------------------------------------
D RKNN: [10:01:02.004] 0    InputOperator    FLOAT16  CPU    \\                           (1,16,8,8)        0/0/0                    2            InputOperator:z
D RKNN: [10:01:02.004] 1    Conv             FLOAT16  NPU    (1,16,8,8),(64,16,3,3),(64)  (1,64,8,8)        1203/9216/9216           22           Conv:conv_in
D RKNN: [10:01:02.004] 2    Max              FLOAT16  CPU    (1,64,8,8),(1)               (1,64,8,8)        0/0/0                    8            Max:clamp
D RKNN: [10:01:02.004] 3    exSwish          FLOAT16  NPU    (1,64,8,8)                   (1,64,8,8)        0/0/0                    16           exSwish:act
D RKNN: [10:01:02.004] 4    OutputOperator   FLOAT16  CPU    (1,64,8,8)                   \\                 0/0/0                    8            OutputOperator:out
D RKNN: [10:01:02.004] ------------------------------------------------------------------------------------------------------------------
I RKNN: [10:01:02.005] 5 Conv FLOAT16 NPU (not a table row)
"""


def test_op_table_rows_and_placement_are_read_from_the_build_log():
    ops = parse_op_table(BUILD_LOG)
    assert [(op.index, op.type, op.target) for op in ops] == [(0, "InputOperator", "CPU"), (1, "Conv", "NPU"), (2, "Max", "CPU"),
                                                             (3, "exSwish", "NPU"), (4, "OutputOperator", "CPU")]
    assert (ops[1].cycles_npu, ops[1].cycles_total, ops[1].rw_kb, ops[1].name) == (9216, 9216, 22, "Conv:conv_in")
    assert placement(BUILD_LOG) == (["Max"], 2)
    assert parse_op_table("no table") == [] and placement("no table") == ([], 0)


def test_torch_stand_in_has_only_what_the_toolkit_imports():
    modules = torch_stand_in()
    torch, nn = modules["torch"], modules["torch.nn"]
    assert torch.nn is nn

    def function():
        return 42

    assert torch.no_grad()(function) is function  # the decorator the GDQ quantizer applies at import time

    class Quantizer(nn.Module):  # the toolkit subclasses nn.Module at import time
        pass

    with pytest.raises(RuntimeError, match="make_rknn_venv.sh --with-torch"):
        Quantizer()
    with pytest.raises(AttributeError, match="make_rknn_venv.sh --with-torch"):
        torch.tensor
    with pytest.raises(AttributeError, match="make_rknn_venv.sh --with-torch"):
        nn.Linear
