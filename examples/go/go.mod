module example.com/onceflow-host

go 1.19
