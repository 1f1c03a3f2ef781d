"""The CUDA launcher's packing of chunks into launches (plain C++, see NOTE: [Chunking])."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import peak

plan_launches = peak._C.plan_launches


def chunks_of(n, chunk):
    return 0 if n == 0 else -(-n // chunk)


def check_plan(numels, chunk, max_tensors, max_blocks):
    launches = plan_launches(numels, chunk, max_tensors, max_blocks)
    seen = []  # (tensor, chunk) in emission order
    expected_first = 0
    for launch in launches:
        assert launch["first_global_chunk"] == expected_first
        slots, blocks = launch["slot_tensor"], launch["blocks"]
        assert 1 <= len(blocks) <= max_blocks
        assert 1 <= len(slots) <= max_tensors
        assert all(numels[t] > 0 for t in slots), "an empty tensor took a slot"
        used = sorted({s for s, _ in blocks})
        assert used == list(range(len(slots))), "every slot is used by a block"
        for slot, c in blocks:
            seen.append((slots[slot], c))
        expected_first += len(blocks)
    expected = [(t, c) for t, n in enumerate(numels) for c in range(chunks_of(n, chunk))]
    assert seen == expected, "every chunk exactly once, in tensor order"
    return launches


def test_tensor_cut_mid_way_continues_in_slot_zero():
    # 10 chunks with 4 blocks per launch: 4 + 4 + 2, the tensor carried twice.
    launches = check_plan([10 * 8], 8, max_tensors=3, max_blocks=4)
    assert [len(l["blocks"]) for l in launches] == [4, 4, 2]
    assert [l["slot_tensor"] for l in launches] == [[0], [0], [0]]
    assert launches[1]["blocks"][0] == (0, 4)


def test_tensor_table_full_closes_after_last_chunk():
    launches = check_plan([1] * 7, 8, max_tensors=3, max_blocks=320)
    assert [l["slot_tensor"] for l in launches] == [[0, 1, 2], [3, 4, 5], [6]]


def test_trailing_empty_tensor_keeps_pending_work():
    # Apex's packer never launched the pending blocks in this case.
    launches = check_plan([5, 5, 0], 8, max_tensors=110, max_blocks=320)
    assert len(launches) == 1 and len(launches[0]["blocks"]) == 2


def test_empty_tensors_take_no_slot_at_the_limit():
    check_plan([1, 0, 1, 0, 0, 1, 1, 0], 8, max_tensors=2, max_blocks=320)


def test_real_limits_many_small_tensors():
    launches = check_plan([4096] * 2000, 65536, max_tensors=110, max_blocks=320)
    assert len(launches) == -(-2000 // 110)


def test_only_empty_tensors_plan_nothing():
    assert plan_launches([0, 0], 8, 3, 4) == []


def test_bad_limits_are_errors():
    with pytest.raises(ValueError, match="chunk_size"):
        plan_launches([1], 0, 3, 4)
    with pytest.raises(ValueError, match="limits"):
        plan_launches([1], 8, 0, 4)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(numels=st.lists(st.integers(0, 70), max_size=40), chunk=st.integers(1, 9),
       max_tensors=st.integers(1, 6), max_blocks=st.integers(1, 12))
def test_plan_properties(numels, chunk, max_tensors, max_blocks):
    check_plan(numels, chunk, max_tensors, max_blocks)
