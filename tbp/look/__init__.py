"""Looking inside a trained model: what it computes on a prompt (``inside``), the interactive page
(``view``, ``view.js``) and the pictures of a run (``plot``)."""
