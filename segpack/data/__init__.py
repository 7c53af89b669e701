"""Grain datasets of packed rows: the row builder, `pack_dataset`, minibatch packing.

Import from the modules (`segpack.data.packed.pack_dataset`, or `segpack.pack_dataset`); this
package's `__init__` imports nothing (importing a module should not run the whole floor).
"""
