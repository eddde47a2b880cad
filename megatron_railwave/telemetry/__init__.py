"""Per-layer telemetry: what a layer call moved and how (``stats``), where it is written
(``commlog``: JSONL files; ``megatron_logging``: Megatron's MoE metrics tracker) and the routing
capture (``capture``: traces the replay tools read)."""
