"""The lazily imported submodule behind ``lazypkg.Model``."""


class Model:
    pass
