"""The lazily imported submodule behind ``lazypkg.Config``."""


class Config:
    pass
