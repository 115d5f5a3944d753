"""Tools beside the engine, not in it: fetching a catalog model (``pull``), and making and
training an EAGLE head's data (``eagle_data``, ``train_eagle``). They import the engine; the
engine imports none of them."""
