"""Files: safe output and validated input. Atomic writes and the commit of a folder as a whole
(``atomic``, ``staging``), the run lock (``locks``), JSON read strictly (``jsonio``) and checked
against a declared shape (``schema``)."""
