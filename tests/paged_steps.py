"""Ragged steps over a paged KV pool for the dsc::paged_attention tests (tests/test_paged_attention.py
on the CPU, tests/gpu/test_gpu_paged_attention.py at real shapes).

A step is built from its sequences (cached tokens, new tokens): a pool of blocks handed out in
a random order, block tables padded with a block no sequence owns, the sequences' rows of q in
a shuffled order, padding sequences (no tokens; their query_start 0, a real row they must not
touch) and padding rows (slot -1). Every pool slot the step must not read (blocks nobody owns,
the new tokens' slots before the write, positions below the first new token's window) holds NaN.

    step = build(Case(Hkv=2, G=4, D=128, BS=16, seqs=((0, 300), (77, 1))), torch.bfloat16, device="cuda")
    paged_attention_reference(*args_of(step))
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ARGS = (
    "q",
    "k",
    "v",
    "k_pool",
    "v_pool",
    "slot_mapping",
    "query_start",
    "query_lens",
    "cache_lens",
    "block_tables",
    "scale",
    "window",
    "softcap",
    "alibi_slopes",
)


@dataclass(frozen=True)
class Case:
    Hkv: int
    G: int  # query heads per kv head
    D: int
    BS: int  # block size
    seqs: tuple  # (cached tokens, new tokens) per sequence; new 0: a padding sequence
    pad_rows: int = 0  # rows of q after the sequences' (decode steps: one per padding sequence)
    window: int = 0
    softcap: float = 0.0  # logit soft-capping (0: none)
    alibi: bool = False  # ALiBi with alibi_slopes_for(H)
    config: dict | None = field(default=None, hash=False)  # the varlen kernel's launch config (None: the table's)
    decode_config: dict | None = field(default=None, hash=False)  # the decode kernel's
    num_splits: int | None = None  # the decode kernel's (None: from shapes)
    path: str | None = None  # paged_attention_triton's: None, the op's choice (decode where T == N, else mixed)
    pool_dtype: str | None = None  # None: q's
    num_blocks: int = 0  # the pool's blocks (0: the sequences' + 3); with max_blocks: steps of equal shapes
    max_blocks: int = 0  # block table columns (0: the longest sequence's + 1)


def alibi_slopes_for(heads: int, device: str = "cpu") -> torch.Tensor:
    """Test slopes [heads] fp32: distinct per head, large enough to move a softmax over a few
    dozen keys (bloom's own are 2^(-8 h / H), down to 2^-8)."""
    return torch.linspace(0.05, 0.6, heads, dtype=torch.float32, device=device)


def decode_case(seqs: tuple, **kw) -> Case:
    """A decode step: T == N, one padding row per padding sequence (new tokens 0)."""
    return Case(seqs=seqs, pad_rows=sum(1 for _, n in seqs if n == 0), **kw)


def build(case: Case, dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> dict:
    """The step's arguments by name (ARGS), pools poisoned where the step must not read."""
    g = torch.Generator(device=device).manual_seed(seed)
    host = torch.Generator().manual_seed(seed)  # the layout's draws
    H, D, BS = case.Hkv * case.G, case.D, case.BS
    N = len(case.seqs)
    lens = [n for _, n in case.seqs]
    T = sum(lens) + case.pad_rows
    rand = lambda *shape: torch.randn(*shape, generator=g, device=device).to(dtype)  # noqa: E731
    q, k, v = rand(1, H, T, D), rand(1, case.Hkv, T, D), rand(1, case.Hkv, T, D)
    need = [-(-(c + n) // BS) for c, n in case.seqs]
    num_blocks = case.num_blocks or sum(need) + 3
    order = torch.randperm(num_blocks, generator=host)
    spare = int(order[-1])  # the block every unused table entry names: poisoned
    block_tables = torch.full((N, case.max_blocks or max(need) + 1), spare, dtype=torch.int32)
    a = 0
    for i, n_blocks in enumerate(need):
        block_tables[i, :n_blocks] = order[a : a + n_blocks].to(torch.int32)
        a += n_blocks
    query_start = torch.zeros(N, dtype=torch.int32)
    row = 0
    for i in torch.randperm(N, generator=host).tolist():  # the rows in a shuffled sequence order
        query_start[i] = row if lens[i] else 0
        row += lens[i]
    slot_mapping = torch.full((T,), -1, dtype=torch.int32)
    unread = torch.ones(num_blocks * BS, dtype=torch.bool)
    for i, (c, n) in enumerate(case.seqs):
        p = torch.arange(c + n)
        slots = block_tables[i, p // BS].long() * BS + p % BS
        slot_mapping[int(query_start[i]) + p[c:] - c] = slots[c:].to(torch.int32)
        lo = max(c - case.window + 1, 0) if case.window else 0  # the first new token's window
        unread[slots[lo:c]] = False
    pool_dtype = getattr(torch, case.pool_dtype) if case.pool_dtype else dtype
    pools = [torch.randn(num_blocks, case.Hkv, BS, D, generator=g, device=device).to(pool_dtype) for _ in range(2)]
    poison = unread.view(num_blocks, BS).to(device)[:, None, :, None]
    for pool in pools:
        pool.masked_fill_(poison, float("nan"))
    ints = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    return dict(
        q=q,
        k=k,
        v=v,
        k_pool=pools[0],
        v_pool=pools[1],
        slot_mapping=slot_mapping.to(device),
        query_start=query_start.to(device),
        query_lens=ints(lens),
        cache_lens=ints([c for c, _ in case.seqs]),
        block_tables=block_tables.to(device),
        scale=D**-0.5,
        window=case.window,
        softcap=case.softcap,
        alibi_slopes=alibi_slopes_for(H, device) if case.alibi else None,
    )


def args_of(step: dict) -> list:
    return [step[name] for name in ARGS]


def expected(step: dict, dtype: torch.dtype = torch.float32) -> tuple:
    """(out of the reference computed in `dtype` on clean copies, the pools after the
    reference's write)."""
    from dsc.kernels.paged_attention import paged_attention_reference, write_paged_kv_reference

    want = {name: step[name].clone() for name in ("k_pool", "v_pool")}
    write_paged_kv_reference(step["k"], step["v"], want["k_pool"], want["v_pool"], step["slot_mapping"])
    clean = {
        **step,
        **{n: step[n].to(dtype) for n in ("q", "k", "v")},
        **{n: step[n].to(dtype).nan_to_num() for n in ("k_pool", "v_pool")},
    }
    return paged_attention_reference(*args_of(clean)), want["k_pool"], want["v_pool"]


def pool_problems(step: dict, want_k, want_v) -> list[str]:
    """The pools against the reference's write (NaN poison compared as a value)."""
    problems = []
    for name, want in (("k_pool", want_k), ("v_pool", want_v)):
        got, exp = step[name].nan_to_num(7.0), want.nan_to_num(7.0)
        if not torch.equal(got, exp):
            problems.append(f"{name} differs from the reference write at {(got != exp).nonzero()[:3].tolist()}")
    return problems
