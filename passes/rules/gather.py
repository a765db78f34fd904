"""Gather and scatter, as embeddings, take_along_axis and their gradients use them.

Splits offered: the batch dimensions of the indices (each device gathers its own rows), the
operand's window dimensions taken whole, and, for a scatter, the operand's indexed dimension
(each device applies the updates that land in its rows). A gather from an operand split on an
indexed dimension it takes one element of at a time (a vocab-parallel embedding lookup, or the
loss's take_along_axis on vocab-sharded logits) is offered too: each device gathers what it
holds, zeros the rest, and the partial results are summed (an all-reduce). That is how XLA's
SPMD partitioner lowers a gather from a trivially sliced operand dimension, and what the
hand-written vocab-parallel Megatron program compiles to (``tests/cost_model/
test_ranking.py`` checks the collectives match).
"""

from jax import lax

from autopar.passes.rules import DimMap, Reduce, RuleContext, register


def _index_batch_dims(idx_rank):
    return list(range(idx_rank - 1))  # the last dimension of the indices is the index vector


@register(lax.gather_p, free=True, gather_scatter=True)
def gather(ctx: RuleContext, *, dimension_numbers, slice_sizes, **_):
    dn = dimension_numbers
    operand, indices = ctx.in_shapes[0], ctx.in_shapes[1]
    out_rank = ctx.out_rank
    batch_out = [d for d in range(out_rank) if d not in dn.offset_dims]
    window_operand = [d for d in range(len(operand))
                      if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    maps = []
    for k, idx_dim in enumerate(_index_batch_dims(len(indices))):
        op_dim = None
        if idx_dim in dn.start_indices_batching_dims:
            op_dim = dn.operand_batching_dims[dn.start_indices_batching_dims.index(idx_dim)]
        maps.append(DimMap((op_dim, idx_dim), (batch_out[k],)))
    for k, op_dim in enumerate(window_operand):
        if slice_sizes[op_dim] == operand[op_dim] and op_dim not in dn.start_index_map:
            maps.append(DimMap((op_dim, None), (dn.offset_dims[k],)))
    for op_dim in dn.collapsed_slice_dims:
        if slice_sizes[op_dim] == 1 and op_dim in dn.start_index_map:
            # finished by an all-reduce only: XLA does not lower a masked gather's sum as a
            # reduce-scatter into a result dim (tests/passes/test_rules_hlo.py)
            maps.append(DimMap((op_dim, None), (Reduce.SUM,), scatter_to=()))
    return maps


def scatter(ctx: RuleContext, *, dimension_numbers, prim_is_add=False, **_):
    dn = dimension_numbers
    operand, indices, updates = ctx.in_shapes[0], ctx.in_shapes[1], ctx.in_shapes[2]
    window_operand = [d for d in range(len(operand))
                      if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
    # The updates' scatter dims correspond, in order, to the batch dims of the indices.
    upd_scatter = [d for d in range(len(updates)) if d not in dn.update_window_dims]
    idx_batch = _index_batch_dims(len(indices))
    maps = []
    for k, op_dim in enumerate(window_operand):
        upd_dim = dn.update_window_dims[k]
        if updates[upd_dim] == operand[op_dim] and op_dim not in dn.scatter_dims_to_operand_dims:
            maps.append(DimMap((op_dim, None, upd_dim), (op_dim,)))
    # Batching dims (take_along_axis and its gradient): all three split together.
    for op_dim, idx_dim in zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims):
        maps.append(DimMap((op_dim, idx_dim, upd_scatter[idx_batch.index(idx_dim)]), (op_dim,)))
    # The indexed dimension of the operand: each device applies the updates that land in its rows.
    for op_dim in dn.inserted_window_dims:
        if op_dim in dn.scatter_dims_to_operand_dims:
            maps.append(DimMap((op_dim, None, None), (op_dim,)))
    # The other scatter dims of the updates with their indices: each device scatters its own
    # updates, and the results are summed (an embedding gradient under data parallelism).
    if prim_is_add:
        for idx_dim, upd_dim in zip(idx_batch, upd_scatter):
            if idx_dim not in dn.scatter_indices_batching_dims:
                maps.append(DimMap((None, idx_dim, upd_dim), (Reduce.SUM,)))
    return maps


# A scatter writes into its operand's buffer (passes.liveness). Plain scatter and scatter-add
# are counted as data movement, the others as one flop per result element.
register(lax.scatter_p, free=True, reducing=True, gather_scatter=True, in_place=True)(scatter)
register(lax.scatter_mul_p, lax.scatter_min_p, lax.scatter_max_p, gather_scatter=True,
         in_place=True)(scatter)


@register(lax.scatter_add_p, free=True, reducing=True, gather_scatter=True, in_place=True)
def scatter_add(ctx: RuleContext, **params):
    return scatter(ctx, prim_is_add=True, **params)


#: Names of this family's primitives, for passes/propagate.py until it asks op_info.
