"""One folder per parallelism behind one protocol (:mod:`.base`): single device, expert
parallelism (``ep/``), data-centric (``datacentric/``), zebra and DistEP (``zebra/``)."""
