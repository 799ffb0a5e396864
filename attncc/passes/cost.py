"""IO cost model: predicted slow-memory bytes and FLOPs, fused kernel vs unfused graph."""

from __future__ import annotations

from dataclasses import dataclass, replace

from attncc.ir import expr as ex
from attncc.ir.graph import Graph, clone, fused_node


@dataclass(frozen=True)
class IOReport:
    fused_fwd_bytes: float
    fused_bwd_bytes: float
    unfused_fwd_bytes: float
    unfused_bwd_bytes: float
    fused_fwd_flops: float
    fused_bwd_flops: float
    unfused_fwd_flops: float
    unfused_bwd_flops: float
    #: the fused forward with fp8 K/V (one byte per element, runtime/fp8.py)
    fp8_fwd_bytes: float = 0.0
    #: what rotating q and k in torch would add (forward and backward) to the in-kernel rope
    rope_saved_bytes: float = 0.0

    def describe(self) -> str:
        mb = 1e6
        rope = f"; in-kernel rope saves {self.rope_saved_bytes / mb:.1f} MB" if self.rope_saved_bytes else ""
        return (
            f"forward: fused {self.fused_fwd_bytes / mb:.1f} MB vs unfused {self.unfused_fwd_bytes / mb:.1f} MB "
            f"({self.unfused_fwd_bytes / self.fused_fwd_bytes if self.fused_fwd_bytes else 1.0:.1f}x less traffic), "
            f"{self.fused_fwd_flops / 1e9:.2f} GFLOP "
            f"(fp8 K/V: {self.fp8_fwd_bytes / mb:.1f} MB); "
            f"backward: fused {self.fused_bwd_bytes / mb:.1f} MB vs unfused {self.unfused_bwd_bytes / mb:.1f} MB, "
            f"{self.fused_bwd_flops / 1e9:.2f} GFLOP{rope}"
        )


@dataclass(frozen=True)
class CostModel:
    """The variant's facts the cost depends on; `predict` evaluates it for one problem."""

    score_ops: int  # elementwise ops in the score map (each a read+write pass when unfused)
    masked: bool
    dropout: bool
    rope_q: bool = False  # the program rotates q (k) in the kernels
    rope_k: bool = False

    def predict(
        self,
        B: int,
        H: int,
        N: int,
        M: int,
        D: int,
        elt: int,
        br: int,
        bc: int,
        density: float = 1.0,
        backward_tiles: tuple[int, int] | None = None,
        Dv: int | None = None,
    ) -> IOReport:
        """Bytes moved to/from slow memory and FLOPs.

        elt: bytes per q/k/v element; br, bc: the forward's tiles (backward_tiles: the
        backward's, if they differ); density: fraction of non-empty tiles; D: q's and k's head
        dim, Dv: v's and out's (default D). Fused: Q, O, lse once; K and V once per visible
        (q tile, kv tile) pair (Algorithm 1's inner loop). Unfused: every op reads and writes
        its N x M operand (scores in fp32). fp8 K/V: the fused forward with K and V read at one
        byte per element. Rope in the kernels saves what rotating q and k in torch moves: q (k)
        read and written once more in the forward, dq (dk) turned back in one more pass.
        """
        Dv = D if Dv is None else Dv
        bh, nm = B * H, N * M
        visible = -(-N // br) * -(-M // bc) * density
        fused_fwd = bh * (N * (D + Dv) * elt + 4 * N + visible * bc * (D + Dv) * elt)
        fp8_fwd = fused_fwd - bh * visible * bc * (D + Dv) * (elt - 1)
        rope_saved = bh * 4 * (N * self.rope_q + M * self.rope_k) * D * elt
        # dK/dV pass: K, V read and dK, dV written once per kv tile, Q/dO/lse/delta per visible
        # pair; dQ pass: Q, dO, lse, delta read and dQ written once, K and V per visible pair.
        bbr, bbc = backward_tiles or (br, bc)
        bvisible = -(-N // bbr) * -(-M // bbc) * density
        fused_bwd = bh * (
            2 * M * (D + Dv) * elt
            + bvisible * bbr * ((D + Dv) * elt + 8)
            + N * ((2 * D + Dv) * elt + 8)
            + bvisible * bbc * (D + Dv) * elt
        )
        s = 4 * nm
        passes_fwd = 2 + (2 * self.score_ops) + (3 if self.masked else 0) + 2 + (3 if self.dropout else 0)
        unfused_fwd = bh * ((N + M) * D * elt + s * passes_fwd + s + M * Dv * elt + N * Dv * elt)
        passes_bwd = 1 + 1 + 3 + (2 * self.score_ops) + (2 if self.masked else 0) + (2 if self.dropout else 0) + 2
        unfused_bwd = bh * (s * passes_bwd + 2 * (N + M) * (D + Dv) * elt)
        # products of one N x M x width each: S = Q K^T (D) and O = P V (Dv) forward; the fused
        # backward recomputes S and dP = dO V^T in both passes and adds dV, dK, dQ; unfused: dP, dV, dK, dQ
        product = 2.0 * bh * nm
        return IOReport(
            fused_fwd, fused_bwd, unfused_fwd, unfused_bwd,
            product * (D + Dv) * density, product * (4 * D + 3 * Dv) * density,
            product * (D + Dv), product * 2 * (D + Dv), fp8_fwd, rope_saved,
        )  # fmt: skip


def _count_ops(e: ex.Expr) -> int:
    return sum(isinstance(n, (ex.Unary, ex.Binary, ex.Where)) for n in ex.walk(e))


def cost(g: Graph) -> Graph:
    """Attach a `CostModel` to the fused node.

    Guarantees: `FusedAttention.cost.predict(...)` gives fused and unfused bytes and FLOPs for
    the forward and backward passes of this variant at any problem size.
    """
    g = clone(g)
    node, op = fused_node(g)
    model = CostModel(
        score_ops=_count_ops(op.score),
        masked=op.mask is not None,
        dropout=op.dropout > 0,
        rope_q=op.q_rope is not None,
        rope_k=op.k_rope is not None,
    )
    g.nodes[node]["op"] = replace(op, cost=model)
    return g
