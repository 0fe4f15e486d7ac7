"""The just-in-time builder of ``csrc/``: which sources and flags (``spec``), the lock that lets one
process build at a time (``lock``), and the build and load itself (``ext``)."""
