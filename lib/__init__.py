"""The library every lesson shares (see README.md, "The files")."""
