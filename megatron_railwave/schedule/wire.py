"""The record wire format: what bytes travel per record, in each direction.

Letters: H hidden, E_node = E / N experts of one node, E_loc = E / W experts of one rank.

One row travels per record (a unique (token, destination node) pair) on stages 1 and 2, and one
row per copy (record x target GPU) on stage 3. A row is the byte concatenation of its parts
(``ops.pack_rows``), in this order:

==================  =======================================================  ==============
message             parts of one row                                         used by
==================  =======================================================  ==============
dispatch            payload [H] (hidden dtype) | probs [E_node] (probs       dispatch forward
                    dtype) | meta [2 + ceil(E_node / 32) + pad] int32
combine             payload [H] (hidden dtype)                               combine forward,
                                                                             combine backward
dispatch_grad       payload [H] (hidden dtype) | probs [E_node] (probs       dispatch backward
                    dtype)
==================  =======================================================  ==============

``meta`` = (source EP rank, token index, the token's routing bits for the node's E_node
experts packed 32 per int32 word, bit b of word w = expert w * 32 + b of the node), then
``pad`` zero words (0 to 3) that make the dispatch row a multiple of 16 bytes where the other
parts allow it (their bytes a multiple of 4): row copies then move 16-byte vectors instead of
falling back to 4-byte accesses (GLM-4.5-Air on 4 x 8: 8192 + 128 + 12 = 8332 B unpadded,
8336 B padded). The target GPU reads its own experts' bits; the target mask itself does not
travel: every GPU predicts it from the gathered counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_railwave.ops import RowSpec, row_bytes

__all__ = ["RecordWireFormat", "META_FIXED_WORDS", "ROUTING_BITS_PER_WORD"]

ROUTING_BITS_PER_WORD = 32
"""Routing bits per int32 metadata word."""
META_FIXED_WORDS = 2
"""Metadata words before the routing bits: source EP rank, token index."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordWireFormat:
    """Per-row layout of every message of one layer (identical on every rank)."""

    hidden: int
    """H: payload elements per row."""
    payload_dtype: torch.dtype
    """dtype of the hidden states (and of their gradients)."""
    probs_dtype: torch.dtype
    """dtype of the routing probabilities (and of their gradients)."""
    experts_per_node: int
    """E_node: probs and routing bits travel for the destination node's experts only."""
    align_rows: bool = True
    """Pad the dispatch row's metadata to a 16-byte row (see the module docstring). The exchange
    always does; the network model's wire (``lab.netmodel.execute.model_wire``) does not, so its
    fitted presets keep the row bytes they were fitted with (4 B of 8336 at GLM size)."""

    def __post_init__(self) -> None:
        if self.hidden < 0 or self.experts_per_node < 1:
            raise ValueError(
                f"wire format needs hidden >= 0 and experts_per_node >= 1, got {self.hidden}, "
                f"{self.experts_per_node}"
            )

    @property
    def meta_words(self) -> int:
        """int32 words of metadata per dispatch row (routing words, then the 16-byte padding)."""
        words = META_FIXED_WORDS + -(-self.experts_per_node // ROUTING_BITS_PER_WORD)
        if not self.align_rows:
            return words
        before = row_bytes(
            [(self.payload_dtype, (self.hidden,)), (self.probs_dtype, (self.experts_per_node,))]
        )
        if before % 4:
            return words  # int32 words cannot align such a row
        return words + (-(before + 4 * words) % 16) // 4

    def dispatch_specs(self) -> list[RowSpec]:
        return [
            (self.payload_dtype, (self.hidden,)),
            (self.probs_dtype, (self.experts_per_node,)),
            (torch.int32, (self.meta_words,)),
        ]

    def combine_specs(self) -> list[RowSpec]:
        return [(self.payload_dtype, (self.hidden,))]

    def dispatch_grad_specs(self) -> list[RowSpec]:
        return [(self.payload_dtype, (self.hidden,)), (self.probs_dtype, (self.experts_per_node,))]

    @property
    def payload_bytes(self) -> int:
        return row_bytes(self.combine_specs())

    @property
    def dispatch_bytes(self) -> int:
        """Bytes of one dispatch row."""
        return row_bytes(self.dispatch_specs())

    @property
    def combine_bytes(self) -> int:
        """Bytes of one combine row (forward combine; also combine's backward)."""
        return row_bytes(self.combine_specs())

    @property
    def dispatch_grad_bytes(self) -> int:
        """Bytes of one row of dispatch's backward."""
        return row_bytes(self.dispatch_grad_specs())

    def to_dict(self) -> dict[str, int | str]:
        return {
            "hidden": self.hidden,
            "payload_dtype": str(self.payload_dtype).removeprefix("torch."),
            "probs_dtype": str(self.probs_dtype).removeprefix("torch."),
            "experts_per_node": self.experts_per_node,
            "meta_words": self.meta_words,
            "dispatch_bytes": self.dispatch_bytes,
            "combine_bytes": self.combine_bytes,
            "dispatch_grad_bytes": self.dispatch_grad_bytes,
        }
