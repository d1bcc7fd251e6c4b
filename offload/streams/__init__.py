"""Everything that moves tensors between host and device, and everything that orders those moves.

- ``copies``: the copy engine; the only place that decides how copies are ordered.
- ``backend``: streams, events and asynchronous copies of a device (CUDA, or a checker's simulation).
- ``host_storage``: a slice's host copies, as views into one flat (pinned) buffer.
- ``slice_entries``: what a slice holds (its parameters and buffers, each once, and where registered).
- ``watched_hooks``: process-wide hooks installed while something watches them.
- ``flat_views``: alignment, dense strides and tensors over a flat byte buffer.
- ``host_buffers``: pooled host buffers for gradients and activations.
- ``device_slots``: the two device slots that slices take turns in.
- ``shadow_staging``: the staging buffers loads cast into when the shadows are not kept (``shadows="disk"``).
- ``activations``: boundary activations offloaded and loaded back.
- ``saved_activations``: the tensors autograd saves in an offloaded slice, to the host and back.
- ``layouts``: the strides and alignment every copy of an input or activation keeps.
- ``gradients``: slice gradients accumulated on the device and offloaded.
- ``workers``: host threads that run host-side work (an optimizer's update) in order, with events.
- ``updates``: pending host updates of slices, and the waits for them before a load.
"""

from .activations import ActivationOffloader, OffloadTicket
from .backend import CudaBackend, Event, StreamBackend, using_backend
from .copies import SYNC_ENV_VAR, CopyStreams
from .device_slots import DeviceSlots
from .slot_references import SlotReference
from .gradients import GradientOffloader, PendingGradients, SliceGradients
from .host_buffers import HostBuffer, HostBufferPool
from .host_storage import SliceStorage, holder_of
from .slice_entries import Entry
from .updates import SliceUpdates
from .workers import HostWorker, WorkerEvent

__all__ = [
    "SYNC_ENV_VAR",
    "ActivationOffloader",
    "CopyStreams",
    "CudaBackend",
    "DeviceSlots",
    "Entry",
    "Event",
    "GradientOffloader",
    "HostBuffer",
    "HostBufferPool",
    "HostWorker",
    "OffloadTicket",
    "PendingGradients",
    "SliceGradients",
    "SliceStorage",
    "SliceUpdates",
    "StreamBackend",
    "SlotReference",
    "WorkerEvent",
    "holder_of",
    "using_backend",
]
