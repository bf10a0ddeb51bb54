"""Gradient buckets and the hooks that say when one is ready: the machinery DDP and ZeRO share.

Backward produces gradients roughly in the reverse of the order parameters were registered (the head's first, the
embedding's last), so parameters are packed into buckets in that reverse order. A bucket is "ready" when every one
of its parameters has had its gradient accumulated in the current backward (`register_post_accumulate_grad_hook`),
and that is when its collective can start while autograd goes on computing earlier layers' gradients. A callback
queued on the autograd engine runs once backward has finished: the strategy waits for its collectives there.
Communicating one bucket of ~25 MB instead of each tensor amortizes each collective's latency (Li et al., 2020,
"PyTorch Distributed", sec. 3.2.3).
"""
import contextlib
import weakref
from dataclasses import dataclass

import torch


@dataclass(eq=False)  # identity, not field-by-field (fields hold tensors)
class Bucket:
    params: list
    offsets: list  # where each parameter starts in the bucket's flat buffer
    numel: int  # padded to a multiple of `pad`, so the buffer splits evenly across ranks
    ready: int = 0  # how many of its parameters' gradients this backward has accumulated (ReadyHooks counts)
    # the strategy's own, set when it wraps the model: ddp.BucketState, zero.BucketState or fsdp.UnitState
    state: object = None


def pack(params, bucket_mb, pad=1):
    """Split params (reverse registration order) into buckets of at least bucket_mb, the last one smaller."""
    buckets, current, size = [], [], 0
    for p in reversed(list(params)):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_mb * 2**20:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return [layout(ps, pad) for ps in buckets]


def layout(params, pad=1):
    """One bucket: params laid end to end in a flat space whose size is padded to a multiple of `pad`."""
    offsets, n = [], 0
    for p in params:
        offsets.append(n)
        n += p.numel()
    return Bucket(list(params), offsets, (n + pad - 1) // pad * pad)


def weak_hook(method, *args):
    """A tensor hook that calls method(tensor, *args) without holding method's object. The hook lives on the tensor,
    and a cycle through a tensor is one the garbage collector cannot always see (torch skips a tensor that C++ also
    holds): a strong reference back to the strategy kept its whole model alive after train.run returned (seen under
    fsdp x tp in a launch of several jobs, 2026-12-02)."""
    ref = weakref.WeakMethod(method)
    return lambda t: ref()(t, *args)


class ReadyHooks:
    """Call on_ready(bucket) as each bucket's last gradient is accumulated, and on_done() when backward ends.

    Inside `no_sync()` nothing is called: gradients just accumulate locally (non-final micro-steps), unless
    `always` is set: then the callbacks run anyway and read `self.sync` themselves (FSDP frees parameters
    either way)."""

    def __init__(self, buckets, on_ready, on_done, always=False):
        self.buckets, self.on_ready, self.on_done, self.always = buckets, on_ready, on_done, always
        self.sync, self.queued = True, False
        self.ready_log = []  # bucket indices in the order they became ready, for tests and the curious
        self.bucket_of = {}
        for b in buckets:
            for p in b.params:
                self.bucket_of[p] = b
                p.register_post_accumulate_grad_hook(weak_hook(self._hook))

    def _hook(self, p):
        if not (self.sync or self.always):
            return
        if not self.queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self.queued = True
        b = self.bucket_of[p]
        b.ready += 1
        if b.ready == len(b.params):
            self.ready_log.append(self.buckets.index(b))
            self.on_ready(b)

    def _end_of_backward(self):
        self.queued = False
        missing = [i for i, b in enumerate(self.buckets) if b.ready != len(b.params)]
        # under no_sync a backward may fill only some buckets: a pipeline's covers one chunk of the rank's stages,
        # and reduce_all() reduces every bucket once the schedule is over
        if missing and self.sync:
            raise RuntimeError(f"buckets {missing} did not receive every gradient in this backward; every parameter "
                               "must take part in the loss (unused parameters are not supported)")
        for b in self.buckets:
            b.ready = 0
        self.on_done()

    def reduce_all(self):
        """Reduce every bucket now, as when one backward has filled them all, then end as a backward ends: what a
        pipeline calls once its schedule has run every backward under no_sync (no single backward of an interleaved
        schedule fills every bucket, and which one comes last differs by rank)."""
        assert self.sync, "reduce_all() runs outside no_sync"
        for b in self.buckets:
            self.on_ready(b)
        self.on_done()

    @contextlib.contextmanager
    def no_sync(self):
        self.sync = False
        try:
            yield
        finally:
            self.sync = True
