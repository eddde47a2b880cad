"""Variable-size point-to-point exchange inside one group (NCCL or gloo).

A rank sends ``send[peer]`` to each peer with a non-empty chunk and receives ``recv_counts[peer]``
rows from each peer with a non-zero count. Both sides derive the counts from the same global
plan, so a message is posted exactly when its peer posts the matching one. The chunk for this
rank itself is copied locally. Several tensors (payload, probs, metadata) go together; tensor i
uses tag i so messages between one pair never cross.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["PendingExchange", "start_exchange"]


@dataclass(kw_only=True, slots=True)
class PendingExchange:
    """Posted messages; ``wait()`` returns, per tensor, the received chunks in peer order."""

    works: list[dist.Work]
    recv: list[list[torch.Tensor]]

    def wait(self) -> list[list[torch.Tensor]]:
        for work in self.works:
            work.wait()
        self.works = []
        return self.recv


def start_exchange(
    send: list[list[torch.Tensor]],
    recv_counts: list[int],
    *,
    group: dist.ProcessGroup | None,
    self_index: int,
) -> PendingExchange:
    """Post the sends and receives of one exchange (asynchronous).

    Args:
        send: per tensor, per peer (group rank), the rows to send: ``send[i][p]`` has shape
            [n_ip, *rest_i]; every tensor i must have the same row count per peer.
        recv_counts: [P] rows expected from each peer (same for every tensor).
        group: the process group (peers are group ranks).
        self_index: this rank's index in ``group``; its own chunk is copied, not sent.

    Returns:
        A ``PendingExchange``. Collective: no (point-to-point). Host sync: no.
    """
    num_peers = len(recv_counts)
    recv: list[list[torch.Tensor]] = []
    ops: list[dist.P2POp] = []
    for i, chunks in enumerate(send):
        assert len(chunks) == num_peers
        like = chunks[self_index]
        out_i = []
        for peer in range(num_peers):
            if peer == self_index:
                assert chunks[peer].shape[0] == recv_counts[peer], "self chunk does not match plan"
                out_i.append(chunks[peer])
                continue
            buf = like.new_empty((recv_counts[peer], *like.shape[1:]))
            out_i.append(buf)
            if chunks[peer].shape[0] > 0:
                ops.append(dist.P2POp(dist.isend, chunks[peer].contiguous(), group=group,
                                      group_peer=peer, tag=i))
            if recv_counts[peer] > 0:
                ops.append(dist.P2POp(dist.irecv, buf, group=group, group_peer=peer, tag=i))
        recv.append(out_i)
    works = dist.batch_isend_irecv(ops) if ops else []
    return PendingExchange(works=list(works), recv=recv)
