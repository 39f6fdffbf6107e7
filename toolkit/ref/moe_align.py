"""moe_align: group the routed (token, slot) pairs by expert and pad each expert's run to whole M-blocks
(vLLM ``moe_align_block_size``).

``ids [T, A] int32`` (expert of each token's a-th slot), ``E`` experts, ``block_m`` ->
``sorted_ids int32 [P]``: flat slot ids ``s = t*A + a`` grouped by expert (ascending expert, slot order kept
within an expert), each expert's run padded with the sentinel ``T*A`` to a multiple of ``block_m``;
``expert_ids int32 [P // block_m]``: the expert of each M-block; ``P = num_tokens_post_padded``.
Experts that receive no token get no block.

``expert_map int32 [E_total]`` (vLLM's, as for expert parallelism; None: the identity): the global expert ids
of ``ids`` are first remapped to this call's local ones ``expert_map[ids]`` in ``[0, E)``, ``E`` = E_local;
a slot whose expert maps to -1 is not in this call and gets no block (its rows of the GEMM outputs stay zero).
"""
import numpy as np

from ..layouts import remap_experts


def moe_align(ids, num_experts: int, block_m: int, expert_map=None):
    flat = np.asarray(ids).reshape(-1)  # [T*A]
    if expert_map is not None:
        flat = remap_experts(flat, expert_map, num_experts)  # [T*A] local ids, -1: no block
    sentinel = flat.size
    runs, blocks = [], []
    for e in range(num_experts):
        slots = np.nonzero(flat == e)[0]  # ascending slot order
        if slots.size == 0:
            continue
        padded = -(-slots.size // block_m) * block_m
        run = np.full(padded, sentinel, np.int32)  # [padded]
        run[: slots.size] = slots
        runs.append(run)
        blocks.append(np.full(padded // block_m, e, np.int32))
    sorted_ids = np.concatenate(runs) if runs else np.zeros(0, np.int32)  # [P]
    expert_ids = np.concatenate(blocks) if blocks else np.zeros(0, np.int32)  # [P // block_m]
    return sorted_ids.astype(np.int32), expert_ids.astype(np.int32), int(sorted_ids.size)
