"""The command line: argument parsing and the commands (``cli``, ``checkcmd``), and what
they print (``ui``'s tables, ``explain``, ``explain_as``, ``draw``, ``summaries``,
``profile``)."""
