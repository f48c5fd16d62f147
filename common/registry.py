"""Name -> class (or builder) registries: mixers and FFNs (model/registry.py), data sources
(data/registry.py). Here, apart from both, so that neither package imports the other."""


class Registry:
    def __init__(self, kind: str):
        self.kind = kind
        self._classes: dict[str, type] = {}

    def register(self, name: str):
        def wrap(cls):
            if name in self._classes:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._classes[name] = cls
            return cls

        return wrap

    def names(self) -> list[str]:
        return sorted(self._classes)

    # As an option's choices (common/validation.py Rule): the names registered when a value is checked, so a
    # block, router or objective registered after the module that declares the option is one of them.
    def __contains__(self, name) -> bool:
        return name in self._classes

    def __iter__(self):
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._classes)

    def get(self, name: str) -> type:
        if name not in self._classes:
            raise ValueError(f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())}")
        return self._classes[name]
