"""The fork server's last preload (see harness.py): everything it imported is moved out of
the garbage collector's reach before the first rank forks. Otherwise each rank's first full
collection walks the ~450,000 objects of torch, Lightning and transformers it inherited:
0.68 CPU-s a rank (gc callbacks in a 2-rank fit), about 40% of a short test rank's time,
over 200 ranks a full run. Frozen objects are never collected while frozen, so the server
thaws them as it exits (its interpreter then frees them, and triton's bindings find nothing
leaked); each rank still collects what it allocates itself."""

import atexit
import gc

gc.freeze()
atexit.register(gc.unfreeze)
