"""The lossy data plane: RPS's two-phase block average as UDP datagrams, closed by deadlines, never resent.

- :mod:`~shaky.comm.udp.wire`: the datagram format (header, payload, tag), the MAC, and which datagrams are used;
- :mod:`~shaky.comm.udp.sockets`: binding, buffer sizes, segmentation offload (GSO/GRO), send batches, and the
  delay line that emulates latency on one machine;
- :mod:`~shaky.comm.udp.exchange`: :class:`UdpExchange` (one rank's end: the two phases, their deadlines and
  masks), its options and counters, :class:`AdaptiveDeadline`, and :func:`run_masks` (every rank's
  observations as the run's masks).
"""

from shaky.native import FASTPATH
from shaky.comm.udp.exchange import (AdaptiveDeadline, ExchangeStats, Fault, UdpExchange, UdpOptions,
                                     python_path_warning, run_masks)
from shaky.comm.udp.sockets import MAX_DATAGRAM_BYTES, MAX_GSO_SEGMENTS, RECV_BATCH, bind_first_free
from shaky.comm.udp.wire import (DTYPE_CODES, FINAL_DATAGRAMS, FLAG_FINAL, FLAG_REPEAT, HEADER, KEY_BYTES, MAGIC,
                                 OVERHEAD_BYTES, PHASES, REJECT_REASONS, TAG_BYTES, VERSION)

__all__ = [
    "DTYPE_CODES", "FASTPATH", "FINAL_DATAGRAMS", "FLAG_FINAL", "FLAG_REPEAT", "HEADER", "KEY_BYTES", "MAGIC",
    "MAX_DATAGRAM_BYTES", "MAX_GSO_SEGMENTS", "OVERHEAD_BYTES", "PHASES", "RECV_BATCH", "REJECT_REASONS",
    "TAG_BYTES", "VERSION", "AdaptiveDeadline", "ExchangeStats", "Fault", "UdpExchange", "UdpOptions",
    "bind_first_free", "python_path_warning", "run_masks",
]
