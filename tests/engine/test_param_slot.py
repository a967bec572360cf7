"""ParamSlot's states: what each strategy keeps of a parameter, and the moves between them (see
[Note: slot states]); pure logic, no process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dspark.engine.param_slot import ParamSlot, SlotState
from tests.messages import assert_names


def _slot(rank: int = 1) -> ParamSlot:
    return ParamSlot(["fc.weight"], nn.Parameter(torch.arange(15.0).reshape(5, 3)), rank=rank, num_ranks=2)


def test_zero3_moves_between_sharded_and_gathered_and_keeps_its_rows() -> None:
    slot = _slot(rank=1)
    assert slot.state is SlotState.WHOLE and slot.gathered
    opt = slot.shard_and_free_full()
    assert slot.state is SlotState.SHARDED and not slot.gathered and slot.param.numel() == 0
    assert opt is not None and torch.equal(opt.detach(), torch.arange(9.0, 15.0).reshape(2, 3))  # rows 3:5
    assert torch.equal(slot.local_shard(), opt.detach()) and slot.held().shape == (3, 3)  # padded chunk
    slot.set_full(torch.arange(18.0))  # chunk 3 x 2 ranks, in memory order
    assert slot.state is SlotState.GATHERED and slot.param.shape == (5, 3)
    slot.free_full()
    assert slot.state is SlotState.SHARDED


def test_zero1_and_zero2_view_the_rows_of_the_whole_parameter() -> None:
    slot = _slot(rank=0)
    opt = slot.view_shard_of_full()
    assert slot.state is SlotState.WHOLE_ROWS and slot.gathered and slot.held() is slot.param
    assert opt.data_ptr() == slot.param.data_ptr() and opt.shape == (3, 3)  # rows 0:3, no copy


@pytest.mark.parametrize("move, state", [
    ("set_full", SlotState.WHOLE), ("free_full", SlotState.WHOLE), ("free_full", SlotState.SHARDED),
    ("shard_and_free_full", SlotState.WHOLE_ROWS), ("view_shard_of_full", SlotState.SHARDED)])
def test_a_move_from_the_wrong_state_is_an_assertion_naming_both(move: str, state: SlotState) -> None:
    slot = _slot()
    if state is SlotState.SHARDED:
        slot.shard_and_free_full()
    elif state is SlotState.WHOLE_ROWS:
        slot.view_shard_of_full()
    with pytest.raises(AssertionError) as caught:
        getattr(slot, move)(*([torch.zeros(18)] if move == "set_full" else []))
    assert_names(str(caught.value), "fc.weight", state.name)
    assert slot.state is state  # refused before anything changed
