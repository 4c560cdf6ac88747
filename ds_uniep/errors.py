"""Errors every backend raises, in a module that imports nothing of ds_uniep (the megakernel
re-exports them: ``from ds_uniep.megakernel import UniEPTimeoutError`` keeps working)."""


class UniEPCommError(RuntimeError):
    """A layer's exchange with its peers failed; the message names the layer, the rank and the step."""


class UniEPTimeoutError(UniEPCommError):
    """A wait on a peer gave up after ``overlap.timeout_s``; the message names the layer, the rank and
    what it waited for (a kernel's signal, or the reference backend's collective)."""
