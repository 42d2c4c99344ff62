"""In-process fakes of the services' collaborators, for fast scheduler unit tests."""
