"""One module per training method (SimCSE, DCPCSE, DiffCSE, DiffAug, D2CSE), each a `cse.models.method.CSEModel`
subclass with its typed config: the paper's objective and the registry's hooks; `crtd.py` is the conditional
replaced-token detection DiffCSE and D2CSE share. The registry (`cse.config.methods`) names each class by its path
here (`cse.models.methods.<name>:<Class>`)."""
