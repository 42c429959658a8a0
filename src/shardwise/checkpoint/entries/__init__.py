"""The state dict as entries: what ``save`` stores and ``load`` fills.

- :mod:`.state_dict`: a state dict taken apart into keyed leaves (Mappings, lists, tuples,
  Stateful objects entered) and put back together (``flatten``, ``restore``).
- :mod:`.items`: what a leaf is to a checkpoint: a tensor's local boxes (a DTensor's in closed
  form through :mod:`.dtensor`), an object's stored form.
- :mod:`.pyjson`: Python values as JSON text, tagged (``pyjson``, ``pyjson2``) so that they
  come back exactly, and decoded strictly.

Pure: no I/O, no collectives.
"""
