"""``planc checkpoint``: a checkpoint folder read against its manifest (``read``),
exported to torch or Hugging Face files (``export``), and the command (``command``)."""
