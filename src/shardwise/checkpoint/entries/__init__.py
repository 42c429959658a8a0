"""The state dict as entries, pure (no I/O, no collectives): :mod:`.state_dict` takes it apart
into keyed leaves and puts it back, :mod:`.items` says what a leaf is to a checkpoint (a
tensor's local boxes, a DTensor's through :mod:`.dtensor`; an object's stored form), and
:mod:`.pyjson` holds Python values as tagged JSON, decoded strictly.
"""
