"""The interceptors: the private dispatch mode and the module-path tracker it reads."""
