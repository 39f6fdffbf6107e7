"""moe_align: group the routed (token, slot) pairs by expert and pad each expert's run to whole M-blocks
(vLLM ``moe_align_block_size``).

``ids [T, A] int32`` (expert of each token's a-th slot), ``E`` experts, ``block_m`` ->
``sorted_ids int32 [P]``: flat slot ids ``s = t*A + a`` grouped by expert (ascending expert, slot order kept
within an expert), each expert's run padded with the sentinel ``T*A`` to a multiple of ``block_m``;
``expert_ids int32 [P // block_m]``: the expert of each M-block; ``P = num_tokens_post_padded``.
Experts that receive no token get no block.
"""
import numpy as np


def moe_align(ids, num_experts: int, block_m: int):
    flat = np.asarray(ids).reshape(-1)  # [T*A]
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
