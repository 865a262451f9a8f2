"""shard_tensor_parallel: Megatron-style tensor parallelism, derived from the graph's dataflow.

Matches  a *region*: linears whose outputs flow only through per-head or elementwise work
         (view/reshape/flatten/transpose/unsqueeze/select, rotary slice/neg/cat/stack/mul/add,
         split/chunk/slice of a fused projection, activations, reductions over other dims,
         elementwise weights split alike, dsc.attention) into linears
         that read them as their input. The first are column-parallel, the second row-parallel:
             q, k, v -> rotary -> dsc.attention -> o        gate, up -> silu, mul -> down
             GPT-2 c_attn -> split(q, k, v) -> dsc.attention -> c_proj;   c_fc -> gelu -> c_proj
         No layer names are consulted: the sharded dim of every value is tracked op by op
         (`Layout`), so a region is accepted only when each op in it is correct per rank.
Rewrites (each counted under `shard_tensor_parallel.<rule>`, per program)
  column    weight and bias get Shard(dim=0, blocks): rank r keeps piece r of every block. The
            blocks come from the split that consumes a fused projection (GPT-2 c_attn:
            (E, E, E)). kv projections with fewer kv heads than ranks get groups=(n_kv,):
            rank r keeps kv head r * n_kv // tp, the kv head of its own q heads.
  row       weight gets Shard(dim=1, blocks); linear(x, W, b) -> add(dsc.all_reduce(linear(x, W)), b):
            the bias stays replicated and is added once, after the sum.
  all_reduce_mean  a mean over the sharded dim (OLMo 2's RMSNorm of all q heads) ->
            dsc.all_reduce(the rank's mean) * (1 / tp): replicated, then broadcast over the shard.
  shape     view/reshape, split/chunk sizes and slice bounds along a sharded dim -> the rank's
            local ones (Phi-3 slices q, k and v out of qkv_proj by offsets).
  kv_cache  the cache tensors hold the local kv heads (model.kv_cache["shape"][1]); a single
            kv head (Falcon-7B's multi-query) is replicated, each rank keeps it whole.
  alibi     an attention's ALiBi slopes [H] (a constant weight) are split with its q heads.
  experts   a dsc.moe (kernels/moe.py) computes the rank's part of its sum, then dsc.all_reduce:
            tensor-parallel (default): every expert's gate and up rows and its down columns are
            split (gate_up Shard(0, blocks of I per expert and projection), down Shard(1));
            expert-parallel (--ep): rank r holds experts [r E/tp, (r+1) E/tp) whole (Shard(0)),
            and its routed ids are made local by subtracting a per-rank constant (ids of other
            ranks' experts fall outside [0, E/tp) and contribute nothing). The router stays
            replicated: every rank routes every token alike. model.notes["tp"]["experts"] says which.
  vocab     when tp divides the vocabulary, the token embedding and lm_head (under its scalar
            scale or soft-cap, if any) are vocab-parallel:
            the rank's rows looked up (dsc.vocab_embedding: zeros for others' ids) + dsc.all_reduce,
            and the rank's logits + dsc.all_gather; otherwise both are replicated.
            model.notes["tp"] says which and why.
Requires canonicalize (every matmul against a weight is aten.linear) and bind_kv_cache
         (attention is dsc.attention with its cache); sizes checked by compiler/validate.py.
Guarantees (tp > 1) every dsc.attention is inside a region; node vals show per-rank shapes;
         the program's logits [batch, vocab] are identical on every rank. tp == 1: no-op.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.fx as fx
from torch.fx.node import Argument

from dsc.compiler.ir import Model, Shard, WeightSpec, copy_meta, infer_val
from dsc.passes._util import arg_int, arg_ints, arg_list, arg_node, aten, attr_name, is_call, is_router

Key = tuple[str, int]  # (column linear's node name, block index): blocks split alike share a class

_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_ELEMENTWISE = {
    aten.mul.Tensor,
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.div.Tensor,
    aten.mul.Scalar,
    aten.add.Scalar,
    aten.neg.default,
    aten.silu.default,
    aten.gelu.default,
    aten.tanh.default,
    aten.sigmoid.default,
    aten.relu.default,
    aten.pow.Tensor_Scalar,
    aten.rsqrt.default,
    aten.exp.default,
    aten.erf.default,
    aten.to.dtype,
    aten.clone.default,
}
_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}
_LOGIT_EPILOGUE = (aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar, aten.tanh.default)
_ATTENTIONS = {
    torch.ops.dsc.attention.default,
    torch.ops.dsc.paged_attention.default,
    torch.ops.dsc.encoder_attention.default,
}  # (an encoder's: no cache)
_PASS_THROUGH = (
    _VIEWS
    | _ELEMENTWISE
    | _REDUCTIONS
    | _SPLITS
    | {
        aten.transpose.int,
        aten.permute.default,
        aten.unsqueeze.default,
        aten.slice.Tensor,
        aten.cat.default,
        operator.getitem,
        *_ATTENTIONS,
        aten.chunk.default,
        aten.stack.default,
        aten.flatten.using_ints,
        aten.select.int,
        aten.type_as.default,
    }
)


class _Unsupported(Exception):
    """This region cannot be sharded exactly; its linears stay replicated."""


class _Refine(Exception):
    """A split cuts a column's output block: split that block (in output features) and retry."""

    def __init__(self, column: str, index: int, sizes: list[int]):
        self.column, self.index, self.sizes = column, index, sizes


@dataclass(frozen=True)
class Layout:
    """A value sharded along `dim` as `blocks` of (global size, key), in order. `scale` = units
    of `dim` per output feature of the column linear the blocks come from (1/head_dim after a
    view to heads)."""

    dim: int
    blocks: tuple[tuple[int, Key], ...]
    scale: Fraction = Fraction(1)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(s for s, _ in self.blocks)


class _Pieces:
    """Union-find over block keys; every block of a class is split into the same number of
    pieces (default: world)."""

    def __init__(self, world: int):
        self.world = world
        self.parent: dict[Key, Key] = {}
        self.n: dict[Key, int] = {}  # class root -> pieces

    def find(self, k: Key) -> Key:
        while self.parent.get(k, k) != k:
            k = self.parent[k]
        return k

    def union(self, a: Key, b: Key) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            if rb in self.n:
                self.set(ra, self.n[rb])
            self.parent[rb] = ra

    def set(self, k: Key, n: int) -> None:
        r = self.find(k)
        if self.n.get(r, n) != n:
            raise _Unsupported(f"block {k} would be split into both {self.n[r]} and {n} pieces")
        self.n[r] = n

    def get(self, k: Key) -> int:
        return self.n.get(self.find(k), self.world)


@dataclass
class _Region:
    columns: list[fx.Node]
    rows: list[fx.Node]
    nodes: list[fx.Node]  # the per-head/elementwise work between them, in graph order


# -- finding regions ------------------------------------------------------------------------


def _is_linear(n) -> bool:
    return is_call(n, aten.linear.default) and getattr(n.args[1], "op", None) == "get_attr"


def _linears_upstream(node: fx.Node) -> set[fx.Node]:
    """Weight linears that reach `node` through pass-through ops only."""
    found, seen, work = set(), set(), [node]
    while work:
        n = work.pop()
        if n in seen:
            continue
        seen.add(n)
        if _is_linear(n):
            found.add(n)
        elif n.op == "call_function" and n.target in _PASS_THROUGH:
            work.extend(n.all_input_nodes)
    return found


def _grow(seed: fx.Node, order: dict[fx.Node, int]) -> _Region:
    """The region of `seed`: taint its output forward; a linear reading a tainted value is a
    row; a linear feeding the work by another path (k, v, up) joins as a column."""
    columns, rows, inner, work = {seed}, set(), set(), [seed]
    while work:
        n = work.pop()
        for u in n.users:
            if _is_linear(u) and u.args[0] is n and n not in u.args[1:]:
                rows.add(u)
            elif u.op == "call_function" and u.target in _PASS_THROUGH:
                if u in inner:
                    continue
                inner.add(u)
                work.append(u)
                for i in u.all_input_nodes:
                    if i not in inner:
                        new = _linears_upstream(i) - columns
                        columns |= new
                        work.extend(new)
            else:
                raise _Unsupported(f"{u.name} ({u.target}) reads the sharded value {n.name}")
    if not rows:
        raise _Unsupported(f"no linear reads the output of {seed.name}")
    if columns & rows:
        raise _Unsupported(f"{sorted(x.name for x in columns & rows)} would be both column and row")
    by_order = order.__getitem__
    return _Region(sorted(columns, key=by_order), sorted(rows, key=by_order), sorted(inner, key=by_order))


# -- layouts ------------------------------------------------------------------------------


def _val(a):
    return a.meta["val"] if isinstance(a, fx.Node) else a


def _fake_mode(model: Model, node: fx.Node):
    """The fake mode of the program's values (torch.export's own, not the tracer's)."""
    return torch._guards.detect_fake_mode([_val(node)]) or model.fake_mode


def _static_prod(dims) -> int:
    p = 1
    for d in dims:
        if not isinstance(d, int):
            raise _Unsupported(f"symbolic size {d} next to a sharded dim")
        p *= d
    return p


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


class _Solver:
    """Assigns a Layout to every value of a region, in graph order, checking each op."""

    def __init__(
        self,
        region: _Region,
        world: int,
        column_blocks: dict[str, tuple[int, ...]],
        outer_views: frozenset[str] = frozenset(),
    ):
        self.region, self.world, self.column_blocks = region, world, column_blocks
        self.outer_views = outer_views  # views read as splitting the sharded dim into (1, rest)
        self.ambiguous: set[str] = set()  # views that read either way
        self.pieces = _Pieces(world)
        self.lay: dict[fx.Node, Layout | list[Layout]] = {}  # a split's value: one layout per piece
        self.kv: dict[fx.Node, int] = {}  # kv-cache get_attr -> local kv heads
        self.slices: dict[fx.Node, tuple[list[Layout], Layout]] = {}  # slice -> (pieces before, its piece)
        self.means: list[tuple[fx.Node, Layout]] = []  # means over the sharded dim, and their input's layout
        self.weights: list[tuple[fx.Node, int, Layout]] = []  # elementwise weights split as (dim, layout)

    def run(self) -> _Solver:
        for c in self.region.columns:
            sizes = self.column_blocks.get(c.name, (_val(c).shape[-1],))
            self.lay[c] = Layout(_val(c).dim() - 1, tuple((s, (c.name, i)) for i, s in enumerate(sizes)))
        for n in self.region.nodes:
            if (lay := self._rule(n)) is not None:  # None: replicated (a mean over the sharded dim)
                self.lay[n] = lay
        for r in self.region.rows:
            self._row(r)
        for n, lay in self.means:
            if any(self.pieces.get(k) != self.world for _, k in lay.blocks):
                raise _Unsupported(f"{n.name} averages replicated pieces that the all-reduce would count twice")
        for n, lay in self.lay.items():
            for l in lay if isinstance(lay, list) else [lay]:
                for size, key in l.blocks:
                    if size % self.pieces.get(key):
                        raise _Unsupported(
                            f"{n.name}: size {size} along dim {l.dim} does not split into {self.pieces.get(key)} pieces"
                        )
        return self

    def local(self, lay: Layout) -> int:
        return sum(s // self.pieces.get(k) for s, k in lay.blocks)

    def shard(self, lay: Layout, dim: int) -> Shard:
        groups = tuple(self.pieces.get(k) for _, k in lay.blocks)
        return Shard(dim=dim, blocks=lay.sizes, groups=None if set(groups) == {self.world} else groups)

    def _lay(self, a: Argument) -> Layout | list[Layout]:
        if not isinstance(a, fx.Node) or a not in self.lay:
            raise _Unsupported(f"{getattr(a, 'name', a)} is not sharded where a sharded value is expected")
        return self.lay[a]

    def _in(self, a: Argument) -> Layout:
        """The layout of the sharded tensor a."""
        lay = self._lay(a)
        if isinstance(lay, list):
            raise TypeError(f"{a} is a split's pieces where one tensor is expected")
        return lay

    def _parts(self, a: Argument) -> list[Layout]:
        """The layouts of the pieces of a split's value a."""
        lay = self._lay(a)
        if not isinstance(lay, list):
            raise TypeError(f"{a} is one tensor where a split's pieces are expected")
        return lay

    def _unify(self, a: Layout, b: Layout) -> None:
        if a.sizes != b.sizes:
            raise _Unsupported(f"blocks {a.sizes} and {b.sizes} meet in one op")
        for (_, ka), (_, kb) in zip(a.blocks, b.blocks):
            self.pieces.union(ka, kb)

    def _rule(self, n: fx.Node) -> Layout | list[Layout] | None:
        t = n.target
        if t in _VIEWS:
            return self._view(n)
        if t in _ELEMENTWISE:
            return self._elementwise(n)
        if t in _REDUCTIONS:
            return self._reduction(n)
        if t in _SPLITS:
            return self._split(n)
        if t in _ATTENTIONS:
            return self._attention(n)
        if t is operator.getitem:
            return self._parts(n.args[0])[arg_int(n, 1)]
        if t is aten.cat.default:
            return self._cat(n)
        if t is aten.chunk.default:  # equal pieces: a split by the output sizes
            return self._split(n)
        if t is aten.stack.default:  # unsqueeze each part, then cat (GPT-J's rotated pairs)
            d = _norm(arg_int(n, 1, 0), _val(n).dim())
            parts = [self._in(a) for a in arg_list(n, 0)]
            for p in parts[1:]:
                if p.dim != parts[0].dim:
                    raise _Unsupported(f"{n.name} stacks values sharded along different dims")
                self._unify(parts[0], p)
            return dataclasses.replace(parts[0], dim=parts[0].dim + (d <= parts[0].dim))
        if t is aten.flatten.using_ints:
            return self._flatten(n)
        if t is aten.type_as.default:  # a cast: the layout of its input (the other gives a dtype)
            return self._in(n.args[0])
        lay, ndim = self._in(n.args[0]), _val(n).dim()
        if t is aten.transpose.int:
            a, b = (_norm(arg_int(n, i), ndim) for i in (1, 2))
            return dataclasses.replace(lay, dim={a: b, b: a}.get(lay.dim, lay.dim))
        if t is aten.permute.default:
            return dataclasses.replace(lay, dim=[_norm(d, ndim) for d in arg_ints(n, 1)].index(lay.dim))
        if t is aten.unsqueeze.default:
            return dataclasses.replace(lay, dim=lay.dim + (_norm(arg_int(n, 1), ndim) <= lay.dim))
        if t is aten.select.int:
            d = _norm(arg_int(n, 1), ndim + 1)
            if d == lay.dim:
                raise _Unsupported(f"{n.name} selects along the sharded dim")
            return dataclasses.replace(lay, dim=lay.dim - (d < lay.dim))
        if t is aten.slice.Tensor:
            if _norm(arg_int(n, 1, 0), ndim) == lay.dim:
                return self._slice(n, lay)
            return lay
        raise _Unsupported(f"no layout rule for {t}")

    def _view(self, n: fx.Node) -> Layout:
        """The sharded dim must be the outermost of its group of merged or split dims."""
        lay = self._in(n.args[0])
        src, dst = _val(n.args[0]).shape, _val(n).shape
        inner_src = _static_prod(src[lay.dim + 1 :])
        extent = inner_src * _static_prod([src[lay.dim]])
        inner = 1
        for j in reversed(range(len(dst))):
            d = _static_prod([dst[j]])
            if inner * d == extent:
                break
            inner *= d
            if inner >= extent:
                raise _Unsupported(f"{n.name} merges the sharded dim with an outer dim")
        else:
            raise _Unsupported(f"{n.name}: no output dim matches the sharded dim")
        if (
            j > lay.dim
            and all(str(a) == str(b) for a, b in zip(src[: lay.dim], dst))
            and all(isinstance(d, int) and d == 1 for d in dst[lay.dim : j])
        ):
            # size-1 dims inserted before the sharded one: a new outer dim (GPT-2's decode
            # [B, E] -> [B, 1, E]) or a split into (1 head, head_dim) (Falcon-7B's one kv head:
            # [B, S, D] -> [B, S, 1, D]); _solve tries the first reading, then the second
            self.ambiguous.add(n.name)
            if n.name in self.outer_views:
                j, inner = lay.dim, extent
        factor = Fraction(inner_src, inner)
        sizes = [s * factor for s in lay.sizes]
        if any(s.denominator != 1 for s in sizes):
            raise _Unsupported(f"{n.name} splits a block across output dims")
        return Layout(j, tuple((int(s), k) for s, (_, k) in zip(sizes, lay.blocks)), lay.scale * factor)

    def _flatten(self, n: fx.Node) -> Layout:
        """flatten(start, end): a view; the sharded dim must be the outermost of a merged range."""
        lay, ndim = self._in(n.args[0]), _val(n.args[0]).dim()
        a, b = _norm(arg_int(n, 1, 0), ndim), _norm(arg_int(n, 2, -1), ndim)
        if lay.dim < a:
            return lay
        if lay.dim > b:
            return dataclasses.replace(lay, dim=lay.dim - (b - a))
        if lay.dim != a:
            raise _Unsupported(f"{n.name} merges the sharded dim with an outer dim")
        factor = _static_prod(_val(n.args[0]).shape[a + 1 : b + 1])
        return Layout(a, tuple((s * factor, k) for s, k in lay.blocks), lay.scale * factor)

    def _elementwise(self, n: fx.Node) -> Layout | None:
        ndim, out = _val(n).dim(), None
        for a in n.args:
            if not isinstance(a, fx.Node) or not isinstance(_val(a), torch.Tensor):
                continue
            shift = ndim - _val(a).dim()
            if a in self.lay:
                lay = self._in(a)
                lay = dataclasses.replace(lay, dim=lay.dim + shift)
                if out is None:
                    out = lay
                elif out.dim != lay.dim:
                    raise _Unsupported(f"{n.name} combines values sharded along different dims")
                else:
                    self._unify(out, lay)
        if out is None:
            return None  # replicated operands only
        for a in n.args:  # replicated operands must broadcast along the sharded dim...
            if isinstance(a, fx.Node) and a not in self.lay and isinstance(_val(a), torch.Tensor):
                i = out.dim - (ndim - _val(a).dim())
                if i < 0 or _val(a).shape[i] == 1:
                    continue
                if a.op == "get_attr" and _val(a).shape[i] == sum(out.sizes):  # ...or be a weight split alike
                    self.weights.append((a, i, out))  # (OLMo 2's q/k norm weight over all heads)
                    continue
                raise _Unsupported(f"{n.name} combines a sharded value with the full {a.name}")
        return out

    def _reduction(self, n: fx.Node) -> Layout | None:
        lay, ndim = self._in(n.args[0]), _val(n.args[0]).dim()
        dims = [_norm(d, ndim) for d in (arg_ints(n, 1) if len(n.args) > 1 else range(ndim))]
        keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
        if lay.dim in dims:
            if n.target is aten.mean.dim and dims == [lay.dim]:  # OLMo 2's q/k norm over all heads
                self.means.append((n, lay))
                return None
            raise _Unsupported(f"{n.name} reduces over the sharded dim")
        return dataclasses.replace(lay, dim=lay.dim - (0 if keep else sum(d < lay.dim for d in dims)))

    def _cat(self, n: fx.Node) -> Layout:
        parts = [self._in(a) for a in arg_list(n, 0)]
        if _norm(arg_int(n, 1, 0), _val(n).dim()) == parts[0].dim:
            raise _Unsupported(f"{n.name} concatenates along the sharded dim")
        for p in parts[1:]:
            if p.dim != parts[0].dim:
                raise _Unsupported(f"{n.name} concatenates values sharded along different dims")
            self._unify(parts[0], p)
        return parts[0]

    def _split(self, n: fx.Node) -> list[Layout]:
        lay, ndim = self._in(n.args[0]), _val(n.args[0]).dim()
        dim = _norm(arg_int(n, 2, 0, kwarg="dim"), ndim)
        sizes = [_val(o).shape[dim] for o in _val(n)]
        if dim != lay.dim:
            return [lay] * len(sizes)
        return self._cut(n, lay, [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)])

    def _slice(self, n: fx.Node, lay: Layout) -> Layout:
        """x[..., a:b] along the sharded dim (Phi-3's q, k, v by offsets): the blocks between a
        and b, cut there first; the rank's slice is its pieces of those blocks."""
        total = sum(lay.sizes)
        a, b, step = list(n.args[2:5]) + [None, None, 1][len(n.args[2:5]) :]
        a, b = (0 if a is None else a), (total if b is None else b)
        if step != 1 or not isinstance(a, int) or not isinstance(b, int):
            raise _Unsupported(f"{n.name} slices the sharded dim with a step or a symbolic bound")
        a, b = (min(x + total if x < 0 else x, total) for x in (a, b))
        cuts = [c for c in (a, b) if 0 < c < total]
        pieces = self._cut(n, lay, cuts)
        before = [p for p, c in zip(pieces, cuts + [total]) if c <= a]
        self.slices[n] = (before, pieces[len(before)])
        return pieces[len(before)]

    def _cut(self, n: fx.Node, lay: Layout, cuts: list[int]) -> list[Layout]:
        """The layouts of the pieces between cuts along the sharded dim; a cut inside a column
        block refines that block first (_Refine)."""
        bounds = [sum(lay.sizes[: i + 1]) for i in range(len(lay.sizes))]
        start = 0
        for size, (col, idx) in lay.blocks:
            inside = [c - start for c in cuts if start < c < start + size]
            if inside:  # the split cuts this column block: make its pieces blocks of their own
                edges = [0] + inside + [size]
                pieces = [Fraction(b - a) / lay.scale for a, b in zip(edges, edges[1:])]
                if any(p.denominator != 1 for p in pieces):
                    raise _Unsupported(f"{n.name} cuts a block inside a head")
                raise _Refine(col, idx, [int(p) for p in pieces])
            start += size
        out, i = [], 0
        for end in cuts + [bounds[-1]]:
            blocks = []
            while i < len(bounds) and bounds[i] <= end:
                blocks.append(lay.blocks[i])
                i += 1
            out.append(Layout(lay.dim, tuple(blocks), lay.scale))
        return out

    def _attention(self, n: fx.Node) -> Layout:
        q, k, v = n.args[:3]
        caches: tuple[fx.Node, ...] = ()
        if n.target is not torch.ops.dsc.encoder_attention.default:
            caches = (arg_node(n, 3), arg_node(n, 4))  # k_cache, v_cache
        lq, lk, lv = self._in(q), self._in(k), self._in(v)
        if (lq.dim, lk.dim, lv.dim) != (1, 1, 1):
            raise _Unsupported(f"{n.name}: q/k/v are not sharded along heads")
        self._unify(lk, lv)
        hq, hkv, w = _val(q).shape[1], _val(k).shape[1], self.world
        if hq % w or (hkv % w if hkv >= w else w % hkv):
            raise _Unsupported(f"{n.name}: {hq} heads / {hkv} kv heads do not split over {w} ranks")
        kv_pieces = w if hkv >= w else hkv  # fewer kv heads than ranks: each is replicated
        for _, key in lq.blocks:
            self.pieces.set(key, w)
        for _, key in lk.blocks:
            self.pieces.set(key, kv_pieces)
        self._check_gqa(n, lq, lk, hq // hkv)
        for c in caches:
            self.kv[c] = hkv // kv_pieces
        if isinstance(slopes := _alibi_slopes(n), fx.Node):  # [H] per q head: split with the q heads
            if slopes.op != "get_attr" or _val(slopes).shape != (hq,):
                raise _Unsupported(f"{n.name}: ALiBi slopes {slopes.name} are not a [{hq}] weight")
            self.weights.append((slopes, 0, Layout(0, lq.blocks, lq.scale)))
        return Layout(2, lq.blocks, lq.scale)

    def _check_gqa(self, n: fx.Node, lq: Layout, lk: Layout, group: int) -> None:
        """Every rank's local q head j must read the kv head of its global q head."""
        qs, ks = self.shard(lq, 0), self.shard(lk, 0)
        for r in range(self.world):
            qh = [h for a, b in qs.ranges(r, self.world) for h in range(a, b)]
            kh = [h for a, b in ks.ranges(r, self.world) for h in range(a, b)]
            if len(qh) % len(kh) or any(kh[j // (len(qh) // len(kh))] != h // group for j, h in enumerate(qh)):
                raise _Unsupported(f"{n.name}: rank {r}'s q heads {qh} do not map onto its kv heads {kh}")

    def _row(self, r: fx.Node) -> None:
        lay = self._in(r.args[0])
        if lay.dim != _val(r.args[0]).dim() - 1:
            raise _Unsupported(f"{r.name} reads a value sharded along a non-feature dim")
        if any(self.pieces.get(k) != self.world for _, k in lay.blocks):
            raise _Unsupported(f"{r.name} reads replicated pieces that the all-reduce would count twice")


def _alibi_slopes(attention: fx.Node):
    """The attention node's `alibi_slopes` argument (BLOOM), None where it has none."""
    assert isinstance(attention.target, torch._ops.OpOverload)  # an op of _ATTENTIONS
    names = [a.name for a in attention.target._schema.arguments]
    if "alibi_slopes" not in names:
        return None
    i = names.index("alibi_slopes")
    return attention.args[i] if i < len(attention.args) else attention.kwargs.get("alibi_slopes")


def _solve(region: _Region, world: int) -> _Solver:
    """Solve, refining column blocks where a split cuts one; where no layout fits, once more
    with the views that insert a size-1 dim before the sharded one read as heads splits."""
    blocks: dict[str, tuple[int, ...]] = {}
    outer: frozenset[str] = frozenset()
    for _ in range(8):
        solver = _Solver(region, world, blocks, outer)
        try:
            return solver.run()
        except _Refine as e:
            col = next(c for c in region.columns if c.name == e.column)
            old = blocks.get(e.column, (_val(col).shape[-1],))
            blocks[e.column] = old[: e.index] + tuple(e.sizes) + old[e.index + 1 :]
        except _Unsupported:
            if solver.ambiguous <= outer:
                raise
            outer |= solver.ambiguous
    raise _Unsupported("block refinement did not converge")


def _find_regions(graph: fx.Graph, world: int) -> tuple[list[_Solver], dict[fx.Node, str]]:
    """Grow a region from every linear not yet in one, in program order. Returns the solved
    regions and, for each linear left replicated, why."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    taken: set[fx.Node] = set()
    solved, reasons = [], {}
    for seed in [n for n in graph.nodes if _is_linear(n)]:
        if seed in taken:
            continue
        try:
            region = _grow(seed, order)
            if taken & set(region.columns + region.rows):
                raise _Unsupported(f"{seed.name}'s region overlaps another region")
            solved.append(_solve(region, world))
        except _Unsupported as e:
            reasons[seed] = str(e)
            continue
        taken |= set(region.columns + region.rows)
    return solved, reasons


# -- rewriting ----------------------------------------------------------------------------


def _set_shard(shards: dict[str, Shard], name: str, shard: Shard) -> None:
    if shards.setdefault(name, shard) != shard:
        raise ValueError(f"weight {name}: programs disagree on its shard ({shards[name]} vs {shard})")


def _rewrite_sizes(n: fx.Node, s: _Solver) -> None:
    """View/reshape and split sizes along a sharded dim -> local sizes."""
    if n.target in _VIEWS:
        lay = s._in(n)
        sizes = arg_list(n, 1)
        if isinstance(sizes[lay.dim], int) and sizes[lay.dim] != -1:
            sizes[lay.dim] = s.local(lay)
            n.args = (n.args[0], sizes, *n.args[2:])
    elif n in s.slices:
        before, piece = s.slices[n]
        start = sum(s.local(p) for p in before)
        n.args = (n.args[0], n.args[1], start, start + s.local(piece), *n.args[4:])
    elif n.target in _SPLITS or n.target is aten.chunk.default:
        src = s._in(n.args[0])
        dim = _norm(arg_int(n, 2, 0, kwarg="dim"), _val(n.args[0]).dim())
        if dim == src.dim:
            local = [s.local(part) for part in s._parts(n)]
            uniform = len(set(local)) == 1 and n.target is aten.split.Tensor
            n.target = aten.split.Tensor if uniform else aten.split_with_sizes.default
            n.args = (n.args[0], local[0] if uniform else local, dim)
            n.kwargs = {}


def _insert_all_reduce(model: Model, row: fx.Node) -> list[fx.Node]:
    """linear(x, W, b) -> add(all_reduce(linear(x, W)), b): the bias is added once. Returns
    the new nodes."""
    g = row.graph
    bias = row.args[2] if len(row.args) > 2 else None
    row.args = row.args[:2]
    with g.inserting_after(row):
        red = copy_meta(g.call_function(torch.ops.dsc.all_reduce.default, (row,)), row)
    out = red
    if bias is not None:
        with g.inserting_after(red):
            out = copy_meta(g.call_function(aten.add.Tensor, (red, bias)), row)
    row.replace_all_uses_with(out, delete_user_cb=lambda u: u not in (red, out))
    model.counters["shard_tensor_parallel.all_reduce"] += 1
    return [red] if out is red else [red, out]


def _all_reduce_mean(model: Model, mean: fx.Node, world: int) -> list[fx.Node]:
    """mean(x, [d], keep) over the sharded dim -> all_reduce(mean of the rank's part) * (1 / tp):
    every rank holds an equal part, so this is the global mean, the same on every rank."""
    g = mean.graph
    with g.inserting_after(mean):
        red = copy_meta(g.call_function(torch.ops.dsc.all_reduce.default, (mean,)), mean)
    with g.inserting_after(red):
        out = copy_meta(g.call_function(aten.mul.Tensor, (red, 1.0 / world)), mean)
    mean.replace_all_uses_with(out, delete_user_cb=lambda u: u is not red)
    model.counters["shard_tensor_parallel.all_reduce_mean"] += 1
    return [mean, red, out]


def _apply_region(model: Model, s: _Solver, shards: dict[str, Shard]) -> list[fx.Node]:
    """Record the region's weight shards and rewrite its graph; returns nodes to re-infer."""
    touched = []
    for c in s.region.columns:
        shard = s.shard(s._in(c), 0)
        for w in c.args[1:]:
            if isinstance(w, fx.Node):
                _set_shard(shards, attr_name(w), shard)
        model.counters["shard_tensor_parallel.column"] += 1
    for n in s.region.nodes:
        if n in s.lay:
            _rewrite_sizes(n, s)
    for n, _lay in s.means:
        touched += _all_reduce_mean(model, n, s.world)
    for w, dim, lay in s.weights:
        _set_shard(shards, attr_name(w), s.shard(lay, dim))
    for r in s.region.rows:
        lay = s._in(r.args[0])
        _set_shard(shards, attr_name(arg_node(r, 1)), s.shard(lay, 1))
        touched += [r, *_insert_all_reduce(model, r)]
        model.counters["shard_tensor_parallel.row"] += 1
    return s.region.columns + s.region.nodes + touched


# -- experts ----------------------------------------------------------------------------

_MOE = torch.ops.dsc.moe.default


def _first_expert_weight(model: Model, gate_up: str, experts: int, world: int) -> str:
    """A per-rank constant: the global id of the rank's first expert, int64[1]."""
    name = gate_up.rsplit(".", 1)[0] + ".first_expert"
    model.weights[name] = WeightSpec(
        sources=(),
        shape=(world,),
        dtype="int64",
        shard=Shard(0, (world,)),
        const=torch.arange(world, dtype=torch.int64) * (experts // world),
    )
    return name


def _shard_experts(model: Model, graph: fx.Graph, world: int, shards: dict[str, Shard]) -> list[fx.Node]:
    """Every dsc.moe: its weights' shards, its sum all-reduced (expert-parallel: local ids)."""
    touched = []
    for n in [n for n in graph.nodes if n.target is _MOE]:
        gate_up, down = n.args[3], n.args[4]
        rows, hidden = model.weights[gate_up.target].shape
        inter = model.weights[down.target].shape[1]
        experts = rows // (2 * inter)
        if model.options.ep > 1:
            _set_shard(shards, gate_up.target, Shard(0, (rows,)))
            _set_shard(shards, down.target, Shard(0, (experts * hidden,)))
            g, ids = n.graph, n.args[1]
            with g.inserting_before(n):
                start = g.get_attr(_first_expert_weight(model, gate_up.target, experts, world))
                with _fake_mode(model, ids):
                    start.meta["val"] = torch.empty(1, dtype=torch.int64)
                # the experts' module path, not the router's: the local ids are not the router's
                # output (dsc diff pairs nodes by module path)
                local = copy_meta(
                    copy_meta(g.call_function(aten.sub.Tensor, (ids, start)), n, ("nn_module_stack",)), ids, ("val",)
                )
            n.args = (n.args[0], local, *n.args[2:])
            touched.append(local)
            model.counters["shard_tensor_parallel.experts_ep"] += 1
        else:
            _set_shard(shards, gate_up.target, Shard(0, (inter,) * (2 * experts)))
            _set_shard(shards, down.target, Shard(1, (inter,)))
            model.counters["shard_tensor_parallel.experts_tp"] += 1
        g = n.graph
        with g.inserting_after(n):
            red = copy_meta(g.call_function(torch.ops.dsc.all_reduce.default, (n,)), n)
        n.replace_all_uses_with(red, delete_user_cb=lambda u: u is not red)
        touched += [n, red]
    return touched


def _experts_note(model: Model, world: int) -> str | None:
    experts = model.arch.experts(model.config)
    if not experts:
        return None
    if model.options.ep > 1:
        return (
            f"expert-parallel: each rank holds {experts // world} of the {experts} experts of every MoE "
            f"layer whole (rank r: experts {experts // world}r to {experts // world}(r + 1) - 1); the router "
            f"is replicated, each rank computes its experts' part of every token's sum, and dsc.all_reduce "
            f"adds the parts"
        )
    inter = model.arch.expert_intermediate(model.config)
    return (
        f"tensor-parallel inside the experts: each rank holds {inter // world} of every expert's {inter} "
        f"MLP columns; the router is replicated and dsc.all_reduce sums the ranks' parts"
    )


# -- vocabulary ---------------------------------------------------------------------------


def _from_input_ids(n) -> bool:
    while is_call(n, *_VIEWS):
        n = n.args[0]
    return getattr(n, "op", None) == "placeholder" and n.name == "input_ids"


def _vocab_nodes(graph: fx.Graph) -> tuple[fx.Node | None, list[fx.Node]]:
    """The lm_head linear (it produces the program's output) and the token embeddings."""
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    while is_call(out, *_LOGIT_EPILOGUE) and not any(isinstance(a, fx.Node) for a in out.args[1:]):
        out = out.args[0]  # scaled or soft-capped logits (compiler/architectures.py LOGIT_EPILOGUES)
    head = out if _is_linear(out) else None
    embs = [
        n
        for n in graph.nodes
        if is_call(n, aten.embedding.default)
        and _from_input_ids(n.args[1])
        and getattr(n.args[0], "op", None) == "get_attr"
    ]
    return head, embs


def _vocab_plan(model: Model, world: int) -> tuple[bool, str]:
    """Split the vocabulary when every vocab weight divides by tp and nothing else reads it."""
    names: set[str] = set()
    uses: set[fx.Node] = set()
    for _, g in model.graphs():
        head, embs = _vocab_nodes(g)
        names |= {attr_name(arg_node(e, 0)) for e in embs} | ({attr_name(arg_node(head, 1))} if head else set())
        uses |= set(embs) | ({head} if head else set())
    if not names:
        return False, "no token embedding or lm_head found"
    rows = {model.weights[n].shape[0] for n in names}
    if any(r % world for r in rows):
        return False, (
            f"replicated: the vocabulary ({', '.join(map(str, sorted(rows)))} rows) does not "
            f"divide by tp={world}, so every rank holds the whole embedding and lm_head"
        )
    for _, g in model.graphs():
        for n in g.nodes:
            if n.op == "get_attr" and n.target in names and any(u not in uses for u in n.users):
                return False, f"replicated: {n.target} is read by more than the embedding and lm_head"
    rows_ = sorted(rows)[0]
    return True, (
        f"vocab-parallel: each rank holds {rows_ // world} of {rows_} vocabulary rows of the "
        f"embedding and lm_head ({', '.join(sorted(names))}). The lookup is masked to the "
        f"rank's rows and summed with dsc.all_reduce (exact: the other ranks add zeros); "
        f"each rank computes its slice of the logits and dsc.all_gather assembles "
        f"[batch, vocab], identical on every rank. Why: the vocabulary matrix is the "
        f"largest weight, and replicating it would cost every rank its full size"
    )


def _vocab_start_weight(model: Model, weight: str, world: int) -> str:
    """A per-rank constant: the first vocabulary row this rank holds, int64[1]."""
    name = weight.removesuffix(".weight") + ".vocab_start"
    rows = model.weights[weight].shape[0]
    model.weights[name] = WeightSpec(
        sources=(),
        shape=(world,),
        dtype="int64",
        shard=Shard(0, (world,)),
        const=torch.arange(world, dtype=torch.int64) * (rows // world),
    )
    return name


def _call(g: fx.Graph, like: fx.Node, target, *args) -> fx.Node:
    n = copy_meta(g.call_function(target, args), like)
    infer_val(n)
    return n


def _split_embedding(model: Model, emb: fx.Node, world: int) -> None:
    """embedding(W, ids) -> all_reduce(dsc.vocab_embedding(W_r, ids, start)): the rank's rows
    looked up where the id is the rank's, zeros elsewhere (one launch, kernels/embedding.py)."""
    g, w, ids = emb.graph, arg_node(emb, 0), arg_node(emb, 1)
    with g.inserting_before(emb):
        start = g.get_attr(_vocab_start_weight(model, attr_name(w), world))
        with _fake_mode(model, ids):
            start.meta["val"] = torch.empty(1, dtype=torch.int64)
        local = _call(g, emb, torch.ops.dsc.vocab_embedding.default, w, ids, start)  # [B, S, E]
        red = _call(g, emb, torch.ops.dsc.all_reduce.default, local)
    emb.replace_all_uses_with(red)
    g.erase_node(emb)
    model.counters["shard_tensor_parallel.vocab_embedding"] += 1


def _split_lm_head(model: Model, head: fx.Node, world: int) -> None:
    """logits = all_gather(linear(h, W_r), -1): [B, V / tp] per rank -> [B, V] on every rank."""
    g = head.graph
    infer_val(head)
    with g.inserting_after(head):
        full = _call(g, head, torch.ops.dsc.all_gather.default, head, _val(head).dim() - 1, world)
    head.replace_all_uses_with(full, delete_user_cb=lambda u: u is not full)
    model.counters["shard_tensor_parallel.vocab_lm_head"] += 1


# -- the pass -----------------------------------------------------------------------------


def _update_vals(
    model: Model, graph: fx.Graph, shards: dict[str, Shard], kv: dict[fx.Node, int], touched: list[fx.Node], world: int
) -> None:
    """Per-rank shapes: weights and kv-cache tensors first, then the rewritten nodes in order."""
    for n in graph.nodes:
        if n.op == "get_attr" and (n.target in shards or n in kv):
            shape = list(_val(n).shape)
            if n in kv:
                shape[1] = kv[n]
            else:
                shape[shards[n.target].dim] = shards[n.target].local_size(world)
            with _fake_mode(model, n):
                n.meta["val"] = torch.empty(shape, dtype=_val(n).dtype)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted(set(touched), key=order.__getitem__):
        if n.op == "call_function":
            infer_val(n)


def _record_vocab_shards(model: Model, head: fx.Node | None, embs: list[fx.Node], shards: dict[str, Shard]) -> None:
    """Vocabulary weights (and an lm_head bias) split by rows."""
    nodes = [arg_node(e, 0) for e in embs] + ([a for a in head.args[1:] if isinstance(a, fx.Node)] if head else [])
    for w in nodes:
        _set_shard(shards, attr_name(w), Shard(0, (model.weights[attr_name(w)].shape[0],)))


def _shard_program(
    model: Model, name: str, graph: fx.Graph, world: int, shards: dict[str, Shard], split_vocab: bool
) -> dict:
    head, embs = _vocab_nodes(graph)
    solved, reasons = _find_regions(graph, world)
    inside = {n for s in solved for n in s.region.nodes}
    for n in graph.nodes:
        if n.target in _ATTENTIONS and n not in inside:
            why = "; ".join(f"{k.name}: {v}" for k, v in list(reasons.items())[:4])
            raise ValueError(
                f"{name}: attention {n.name} is not between linears this pass can shard for tp={world}: {why}"
            )
    touched, kv = [], {}
    for s in solved:
        touched += _apply_region(model, s, shards)
        kv.update(s.kv)
    touched += _shard_experts(model, graph, world, shards)
    if split_vocab:
        _record_vocab_shards(model, head, embs, shards)
    _update_vals(model, graph, shards, kv, touched, world)
    if split_vocab:
        for e in embs:
            _split_embedding(model, e, world)
        if head is not None:
            _split_lm_head(model, head, world)
    heads = set(kv.values())
    if len(heads) > 1:
        raise ValueError(f"{name}: layers disagree on local kv heads {sorted(heads)}")
    return {
        "kv_heads": heads.pop() if heads else None,
        "replicated": [attr_name(arg_node(n, 1)) for n in reasons if n is not head and not is_router(n)],
    }


def shard_tensor_parallel(model: Model) -> Model:
    world = model.options.tp
    if world == 1:
        return model
    split_vocab, vocab_note = _vocab_plan(model, world)
    shards: dict[str, Shard] = {}
    facts = {}
    for name, graph in model.graphs():
        facts[name] = _shard_program(model, name, graph, world, shards, split_vocab)
    for w, shard in shards.items():
        model.weights[w] = dataclasses.replace(model.weights[w], shard=shard)
    kv_local = facts["decode"]["kv_heads"] if "decode" in facts else None
    if model.kv_cache and kv_local:
        kv_global = model.kv_cache["shape"][1]
        model.kv_cache = {
            **model.kv_cache,
            "shape": [model.kv_cache["shape"][0], kv_local, *model.kv_cache["shape"][2:]],
        }
        kv_note = f"{kv_global} kv heads over {world} ranks: " + (
            f"{kv_local} per rank"
            if kv_global >= world
            else f"fewer kv heads than ranks, so each kv head is replicated on {world // kv_global} "
            f"ranks (rank r holds kv head r * {kv_global} // {world}, the one its q heads read)"
        )
    else:
        kv_note = "no kv cache"
    kv_local = facts["ragged"]["kv_heads"] if "ragged" in facts else None
    if model.kv_pool and kv_local:
        model.kv_pool = {**model.kv_pool, "kv_heads": kv_local}
    replicated = sorted({r for f in facts.values() for r in f["replicated"]})
    model.notes["tp"] = {
        "size": world,
        "vocab": vocab_note,
        "kv_heads": kv_note,
        "row_bias": "row-parallel biases stay replicated and are added once, after dsc.all_reduce",
        "norms": "replicated (they act on the full hidden state between regions)",
        **({"experts": note} if (note := _experts_note(model, world)) else {}),
        **({"replicated_linears": replicated} if replicated else {}),
    }
    return model
