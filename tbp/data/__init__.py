"""Data: text to tokens to batches. Corpora of any size (``corpus``, ``compressed``), tokenizers
(``tokenizer``, ``pieces``), the preparation every dataset format shares (``prepare``) and each
format's own (``texts``, ``pairs``, ``chat``), a prepared dataset read back (``datasets``) and
the training batches drawn from it (``batches``)."""
