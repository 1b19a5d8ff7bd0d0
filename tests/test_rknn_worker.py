"""The conversion worker without the toolkit: the torch stand-in it installs when .venv-rknn has no torch."""

import pytest

from anima_ui.convert.rknn_worker import torch_stand_in


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
