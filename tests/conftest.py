import pytest
import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, computed in float64."""
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
