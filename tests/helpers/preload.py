"""Imported once by the fork server the ranks start from (``tests.helpers.dist.PRELOAD``): the C++ extensions
each rank would load, loaded there once, as the settings of the test process that started the server choose
(``_prebuild_extensions`` has built them; a failure to load is remembered, as a rank would remember it)."""

from tests.helpers.dist import _prebuild_extensions

_prebuild_extensions()
