"""zero3's default units (pure logic, no process group): every child of a ModuleList/Sequential,
split further inside a unit only into pieces worth a collective of their own."""

from __future__ import annotations

from torch import nn

from dspark.engine.zero3_units import MIN_NESTED_UNIT_BYTES, unit_modules


class _Block(nn.Module):
    """A residual block whose shortcut is a small Sequential (a ResNet's projection shortcut)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Linear(width, width)
        self.shortcut = nn.Sequential(nn.Linear(width, width, bias=False), nn.LayerNorm(width))


def _names(model: nn.Module, policy=None) -> list[str]:
    return [name for name, _ in unit_modules(model, policy)]


def test_small_containers_inside_a_unit_stay_with_it() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(_Block(8), _Block(8)))
    # before the floor: "1.0", "1.0.shortcut.0", "1.0.shortcut.1", ... each its own all-gather
    assert _names(model) == ["", "0", "1"]


def test_nested_pieces_of_at_least_the_floor_are_units() -> None:
    width = 512  # 512 x 512 fp32 = 1 MiB per Linear
    assert width * width * 4 >= MIN_NESTED_UNIT_BYTES
    model = nn.Sequential(nn.Sequential(_Block(width), _Block(width)), nn.Linear(width, 2))
    assert sorted(_names(model)) == ["", "0", "0.0", "0.0.shortcut.0", "0.1", "0.1.shortcut.0", "1"]


def test_top_level_blocks_are_units_however_small() -> None:
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(3)])
    assert _names(model) == ["", "0", "1", "2"]


def test_an_explicit_policy_is_taken_as_given() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(_Block(8), _Block(8)))
    assert _names(model, [nn.LayerNorm]) == ["", "1.0.shortcut.1", "1.1.shortcut.1"]
