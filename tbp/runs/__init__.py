"""A run on disk: its files and how they are read (``disk``: names, ``RunRecord``,
``load_model``), the commit that saves a checkpoint whole (``commit``), and the runs of a folder
listed (``listing``)."""
