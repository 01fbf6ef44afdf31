"""The corpus on disk: its layout (:mod:`.format`), the text that ships with Python
(:mod:`.documents`), and how text files become a tokenised corpus (:mod:`.prepare`, what
``recipes/prepare_data.py`` runs). None of it imports torch or Lightning: preparing data and
checking a run's ``data.path`` start in a second; the training side, which packs the corpus
into rows, is :mod:`lightning_hetermoe.model.corpus`."""
