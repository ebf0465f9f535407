def register(sub, common):
    pass
