"""A small English text bundled for examples/bytes.py (byte tokens; see its docstring)."""

TEXT = """The planc compiler reads a training plan and writes a program for every device. A plan names a
cluster of hosts and the devices inside them, a model, the data it learns from, and how the work is cut:
the layers into pipeline stages, each stage over a mesh of devices, the rows of every micro-batch over
the data axis and the weights of the large matrices over the tensor axis. The compiler measures the
model once, chooses where each stage runs so that the slow links carry the least, writes the gradient
reduction as a program of collectives that suits the hierarchy of the cluster, and proves that no rank
waits for a message that never comes. Then every rank trains its part: it receives activations from
the stage before it, runs its layers forward, sends the result on, and later receives the gradient of
what it sent and runs its layers backward. When the last micro-batch of a step is done, the gradients
are summed over the data axis and the optimizer takes one step. A small model learns this paragraph
byte by byte: it sees a window of characters and is asked, at every position, which character comes
next. Spaces and the letter e are easy; the start of a word is hard. The loss falls quickly at first,
while the model learns the frequencies of single bytes, and slowly afterwards, as it learns which byte
follows which. Nothing here is downloaded: the text is part of the examples, and any other file on
the machine can take its place.
"""
