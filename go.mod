module github.com/nbdmapper/nbdmapper

go 1.26.0

require (
	github.com/pojntfx/go-nbd v0.3.2 // indirect
	github.com/prometheus/client_golang v1.25.0 // indirect
	golang.org/x/sys v0.50.0 // indirect
)
