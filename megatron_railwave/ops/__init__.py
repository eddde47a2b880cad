"""RailWave data-movement ops: records from routing, RailBalance egress, row packing and the
fixed-order segment sum.

``megatron_railwave.ops.<name>`` is the public API. Today every op is the pure-torch
reference (``ops.reference``), which defines the meaning; the compiled ops (csrc/, exposed as
``torch.ops.railwave.*``) replace them when the extension is built.
"""

from .reference import (RowSpec, assign_egress, pack_rows, records_from_routing, records_per_node_rail, row_bytes,
                        segment_sum, unpack_rows)

__all__ = [
    "RowSpec",
    "records_from_routing",
    "assign_egress",
    "pack_rows",
    "unpack_rows",
    "row_bytes",
    "segment_sum",
    "records_per_node_rail",
]
